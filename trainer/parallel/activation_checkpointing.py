"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Modes (activation_checkpoint.mode):
  full       every block keeps only its input; its forward runs again in backward.
  selective  with selective_ac_option = N: every N-th block (layer index divisible by N) as in
             full, the others keep everything; with "op": every block keeps the outputs of its
             expensive ops (matmuls, attention, collectives) and recomputes the cheap ones
             (norms, activations, RoPE).
  memory_budget  nothing here: torch's partitioner chooses what each compiled block keeps,
             within activation_checkpoint.memory_budget (trainer/parallel/compile.py).

Only functional collectives (`_c10d_functional`, which return new tensors) can be kept: a blocking
c10d call writes into a tensor it is given, and a recompute that skips it would leave that tensor
unwritten. So the forward collectives inside blocks are functional: DTensor's (TP), and CP's ring
attention is one custom op (`trainer::ring_attention`, trainer/parallel/ring_attention.py) whose
outputs are kept whole: the recompute neither sends the keys and values around the ring again
nor keeps any per-step partial result.

The recompute runs inside the block's forward (`BlockRuntime.recompute`), so parameter names,
FSDP units and pipeline stages are the same with and without it. Layer indices are global, so a
pipeline-parallel run checkpoints the same blocks as a run without pipelining.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.models.llama3.runtime import Recompute


def _ops_worth_saving() -> set:
    import trainer.parallel.ring_attention  # noqa: F401  (registers torch.ops.trainer)

    aten, c10d, ours = torch.ops.aten, torch.ops._c10d_functional, torch.ops.trainer
    names = [(aten, "mm"), (aten, "addmm"), (aten, "bmm"),
             (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
             (aten, "_scaled_dot_product_cudnn_attention"), (aten, "_scaled_dot_product_flash_attention_for_cpu"),
             (aten, "_scaled_dot_product_attention_math"),
             (c10d, "reduce_scatter_tensor"), (c10d, "all_gather_into_tensor"), (ours, "ring_attention")]
    return {getattr(getattr(ns, name), "default") for ns, name in names if hasattr(ns, name)}


def _save_expensive_ops(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all(compute, *args):
    return checkpoint(compute, *args, use_reentrant=False)


def recompute_cheap_ops(compute, *args):
    policy = partial(_save_expensive_ops, _ops_worth_saving())
    return checkpoint(compute, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, policy))


RECOMPUTE_ALL = Recompute("all", recompute_all)
RECOMPUTE_CHEAP_OPS = Recompute("cheap ops", recompute_cheap_ops)


def apply_ac(model: torch.nn.Module, mode: str, selective_option: str) -> dict[str, Recompute | None]:
    """The recompute strategy of each block of `model` (a whole Llama or a pipeline stage), by
    block name (BlockRuntime.recompute); None: the block keeps its activations."""
    if mode in ("none", "memory_budget"):  # memory_budget: the compiler decides (compile.set_memory_budget)
        return {name: None for name in model.layers}
    if mode == "full":
        return {name: RECOMPUTE_ALL for name in model.layers}
    if selective_option == "op":
        return {name: RECOMPUTE_CHEAP_OPS for name in model.layers}
    return {name: RECOMPUTE_ALL if int(name) % int(selective_option) == 0 else None for name in model.layers}
