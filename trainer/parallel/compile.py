"""torch.compile per transformer block, and of the loss.

Blocks are compiled one by one, in place (`nn.Module.compile`), so parameter names, FSDP units
and pipeline stages do not change, and FSDP's per-block communication stays outside the
compiled graphs. All blocks run the same code on the same shapes, which keeps recompilation low.

Compiled code is only ever given plain tensors. Under tensor parallelism the token embedding's
output (reduce-scattered over the sequence) and, without loss parallelism, the all-gathered
logits leave their eager modules as `AsyncCollectiveTensor`s: wrappers whose collective may
still be in flight. torch 2.13's AOTAutograd mishandles such a wrapper as a graph input: it
traces a separate graph for it, and the gradient that graph returns for its input is wrong
(with FSDP on the TP ranks: a different step-1 gradient norm, and a different loss when
inductor reorders the wait; without FSDP: `'Tensor' object has no attribute '_local_tensor'` in
backward). `wait_for_collectives` resolves the wrapper in eager code first, without a copy;
docs/torch_workarounds.md gives a minimal reproduction of the torch bug.

The ranks of a machine share torch's compile cache folder (TORCHINDUCTOR_CACHE_DIR), but each
rank's compiled graphs are keyed by its place in the layout (`key_compiled_graphs_by_rank`).
torch keys a cached graph by the traced program, not by the rank's place in the device mesh,
while DTensor bakes that place into what it lowers beneath the trace (loss parallelism's
vocabulary offset): ranks sharing the folder without the key load each other's loss on a warm
start, and the loss is wrong without any error (docs/torch_workarounds.md has the reproduction).
The generated kernels stay shared: a kernel is cached by its own source, so a rank loads the
kernels other ranks and layouts built (on CPU a file lock makes a rank wait for a kernel another
is building rather than build it again).

Full recomputation (activation_checkpoint.mode full, and the recomputed blocks of a selective
layer mode) stays outside the compiled graph: the block's `compute` is compiled and the eager
checkpoint reruns it in backward. Inside the graph, torch 2.13's partitioner saves the RNG state
of the recomputed attention after the device mesh it also saves, and the compiled forward of a
tensor-parallel block stops with "expected all tensors_saved_with_vc_check to be Tensors".
The op-level selective policy must see each op, so those blocks are compiled whole, policy inside.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from trainer.models.llama3.runtime import Compile, Recompute
from trainer.parallel.activation_checkpointing import RECOMPUTE_ALL


class _WaitForCollective(torch.autograd.Function):
    """Identity whose output is the waited, plain tensor inside an AsyncCollectiveTensor; its
    gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, wrapped: AsyncCollectiveTensor) -> torch.Tensor:
        return wrapped.trigger_wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wait_for_collectives(value):
    """`value` as a plain tensor when it is an AsyncCollectiveTensor, else unchanged."""
    return _WaitForCollective.apply(value) if isinstance(value, AsyncCollectiveTensor) else value


_user_tag: str | None = None


def key_compiled_graphs_by_rank(rank: int, degrees: dict[str, int]) -> str:
    """Add this rank's place in the layout to the key of every compiled graph torch caches
    (torch.compiler.config.cache_key_tag, after the user's own tag): the same rank under the same
    degrees holds the same mesh coordinates, so what it finds under that key is what it would
    compile. Call before compiling; returns the tag."""
    global _user_tag
    if _user_tag is None:  # the user's tag (TORCH_COMPILE_CACHE_KEY_TAG), before this process changed it
        _user_tag = torch.compiler.config.cache_key_tag
    layout = "x".join(f"{name}{degree}" for name, degree in degrees.items())
    tag = "-".join(part for part in (_user_tag, f"rank{rank}", layout) if part)
    torch.compiler.config.cache_key_tag = tag
    return tag


def set_memory_budget(budget: float) -> None:
    """The share of activations the partitioner keeps in compiled graphs (activation_checkpoint
    mode memory_budget; 1.0, torch's default, keeps what backward needs and recomputes nothing).
    A setting of the process: set at every build, so a run never inherits another's."""
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = budget
    # Between 0 and 1 the partitioner sizes every value a graph could keep, and torch 2.13 refuses
    # to size a script object ("Cannot compute the size of FakeScriptObject"). The only ones in
    # these graphs are DTensor's device meshes under TP, which hold no activations: size 0.
    # torch 2.11 has no such setting (nor the refusal it answers): set it only where it exists.
    if hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        torch._functorch.config.unsafe_treat_script_objects_as_zero_size = True


def apply_compile(recompute: dict[str, Recompute | None], backend: str) -> dict[str, Compile]:
    """How each block is compiled (BlockRuntime.compile), given its recompute: a fully recomputed
    block's computation alone (the checkpoint stays eager, around the graph), any other block
    whole. The embedding runs eagerly and feeds the first compiled block: its output goes through
    `wait_for_collectives` (ModelRuntime.embedding_output)."""
    return {name: Compile("compute" if policy is RECOMPUTE_ALL else "block", backend)
            for name, policy in recompute.items()}


def compile_loss(loss_fn: Callable, backend: str) -> Callable:
    """`loss_fn(logits, labels)` compiled; its inputs are resolved first (see the module docstring)."""
    compiled = torch.compile(loss_fn, backend=backend)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return compiled(wait_for_collectives(logits), labels)

    return loss
