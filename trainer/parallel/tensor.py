"""Tensor parallelism with sequence parallelism (Megatron-style), on the `tp` mesh.

Inside a block, the attention projections and the SwiGLU FFN are split by heads / hidden units:
wq, wk, wv, w1, w3 column-wise (each rank computes some heads / units in full), wo and w2
row-wise (each rank's partial sums are reduce-scattered). Between those, the residual stream,
the RMSNorms and the embedding output are split along the sequence (sequence parallelism), so
activations outside attention and FFN are never replicated across TP ranks:

    x (B, T/tp) -norm-> all-gather -> (B, T) -> attention / FFN -> reduce-scatter -> (B, T/tp)

The RMSNorm weights are replicated over the TP ranks, but each rank sees only its tokens, so
their gradient is a partial sum that must be all-reduced over TP. DTensor would do that in the
parameter's dtype (bfloat16 under mixed precision) when FSDP asks for the replicated gradient;
`ReduceGradient` does it first, in the configured reduce dtype, so no gradient is summed in bf16.

The token embedding is split by vocabulary rows, the output projection by vocabulary columns.
With loss parallelism the logits stay split by vocabulary and the cross-entropy is computed on
the shards (torch's `loss_parallel`), never gathering a (B, T, vocab) tensor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainer.models.llama3.runtime import NormWeights
from trainer.parallel.dims import sync_group_size
from trainer.parallel.float8_tp import carry_float8_over_gloo, group_plan
from trainer.parallel.reduced_sync import apply_reduced_sync


class ReduceGradient(torch.autograd.Function):
    """Identity on a replicated weight (a DTensor); backward all-reduces its partial gradient over
    the mesh in `dtype`, then casts the sum back to the weight's dtype (autograd requires it)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if all(p.is_replicate() for p in grad.placements):
            return grad, None
        replicated = [Replicate()] * grad.device_mesh.ndim
        return grad.to(ctx.dtype).redistribute(placements=replicated).to(grad.dtype), None


def reduce_gradient_in(dtype: torch.dtype | None, weight: torch.Tensor) -> torch.Tensor:
    """`weight`, whose gradient is summed over the mesh in `dtype` (None: the weight's dtype)."""
    return ReduceGradient.apply(weight, dtype or weight.dtype)


@dataclass(frozen=True)
class TensorParallelParts:
    """What tensor parallelism changes in how the blocks compute (their BlockRuntime fields)."""

    norm_weights: NormWeights | None  # the blocks' norms
    final_norm_weights: NormWeights | None
    syncs: dict | None = None  # reduced sync: each block's forward, by block name
    local_shard_weights: bool = False  # reduced sync: linear layers compute with their local shard


def apply_tp(model: torch.nn.Module, tp_mesh, *, loss_parallel: bool, reduce_dtype: torch.dtype | None = None,
             sync: str = "full", sync_group: int = 0, n_layers: int = 0, float8: bool = False) -> TensorParallelParts:
    """Split `model` (a whole Llama or one pipeline stage of it) over the TP ranks: its weights in
    place, and what the blocks' runtime needs returned.
    `reduce_dtype` is the precision of the norm weights' gradient all-reduce (None: their dtype).
    `sync` other than "full" synchronizes the blocks' residual stream less often (reduced_sync.py):
    once per block, or once per `sync_group` of the model's `n_layers` blocks.
    `float8`: the blocks hold float8 layers (model.converters), split with torchao's float8 styles
    where they scale whole tensors (float8_tp.py)."""
    outer = {}
    if model.tok_embeddings is not None:
        outer["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        outer["norm"] = SequenceParallel()
    if model.output is not None:
        outer["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # the loss needs the DTensor to compute on shards
        )
    parallelize_module(model, tp_mesh, outer)
    # A tied model: each plan distributed its own copy; both split the (vocab, dim) matrix by
    # vocabulary rows (Shard(0)), so one DTensor parameter serves both again.
    model.tie_weights()
    dtype = str(reduce_dtype).removeprefix("torch.") if reduce_dtype is not None else "the weight's dtype"
    summed = NormWeights(f"TP gradient sum in {dtype}", partial(reduce_gradient_in, reduce_dtype))
    if sync != "full":
        syncs, partial_sums = apply_reduced_sync(model, tp_mesh, sync_group_size(sync, sync_group), n_layers, summed)
        return TensorParallelParts(partial_sums, summed if model.norm is not None else None, syncs, True)
    if float8 and torch.distributed.get_backend(tp_mesh.get_group()) == "gloo":
        carry_float8_over_gloo()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                                            **block_group_plan(block, float8)})
    if reduce_dtype is None:
        return TensorParallelParts(None, None)
    return TensorParallelParts(summed, summed if model.norm is not None else None)


def block_group_plan(block, float8: bool) -> dict:
    """A block's attention and FFN: column-wise in, row-wise out to the sequence split; the group's
    input gathered once (float8_tp.group_plan, with `float8` layers or without)."""
    # The attention's inputs: the hidden states, RoPE, the documents (when masked).
    layouts = {"attention": ((Shard(1), None, None), (Replicate(), None, None)),
               "feed_forward": ((Shard(1),), (Replicate(),))}
    plan = {}
    for name, (inputs, gathered) in layouts.items():
        plan |= group_plan(block.get_submodule(name), name, inputs, gathered, Shard(1), float8)
    return plan


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Forward and backward of a vocabulary-sharded loss must run inside torch's loss_parallel."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def enable_async_tp(tp_mesh, device: torch.device) -> None:
    """Let the compiler overlap TP collectives with the matmuls next to them (CUDA only)."""
    if device.type != "cuda":
        raise RuntimeError("parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory)")
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
