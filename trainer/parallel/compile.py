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

Each rank compiles into a cache folder of its own (`isolate_compile_cache`). torch's compiled-code
cache is keyed by the traced program, not by the rank's place in the device mesh, while DTensor
bakes that place into what it lowers beneath the trace (loss parallelism's vocabulary offset):
ranks of one machine sharing the default folder load each other's loss on a warm start, and
the loss is wrong without any error (docs/torch_workarounds.md has the reproduction).

Full recomputation (activation_checkpoint.mode full, and the recomputed blocks of a selective
layer mode) stays outside the compiled graph: the block's `compute` is compiled and the eager
checkpoint reruns it in backward. Inside the graph, torch 2.13's partitioner saves the RNG state
of the recomputed attention after the device mesh it also saves, and the compiled forward of a
tensor-parallel block stops with "expected all tensors_saved_with_vc_check to be Tensors".
The op-level selective policy must see each op, so those blocks are compiled whole, policy inside.
"""

from __future__ import annotations

import os
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


_cache_base: str | None = None


def isolate_compile_cache(rank: int, degrees: dict[str, int]) -> str:
    """Point torch's compile cache (TORCHINDUCTOR_CACHE_DIR, the default folder when unset) at
    a subfolder of this rank in this layout: the same rank under the same degrees holds the same
    mesh coordinates, so what it finds there is what it would compile. Call before compiling."""
    global _cache_base
    if _cache_base is None:  # the user's folder (or torch's default), before this process changed it
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        _cache_base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    layout = "x".join(f"{name}{degree}" for name, degree in degrees.items())
    folder = os.path.join(_cache_base, f"rank{rank}-{layout}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


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
