"""Data parallelism with FSDP2 (`fully_shard`): FSDP, HSDP and DDP from one entry point.

The data-parallel mesh has two dimensions, (dp_replicate, dp_shard_cp):
  FSDP  1 x N   parameters, gradients and optimizer state sharded over N ranks (ZeRO-3-like);
  HSDP  R x N   sharded within groups of N, replicated across R groups;
  DDP   R x 1   every rank holds everything and gradients are all-reduced.
Context-parallel ranks are part of the shard dimension: they hold different tokens of the same
rows, so their gradients are summed like those of data-parallel ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' computes in bfloat16 on CUDA and float32 on CPU (where bfloat16 matmuls are slow).
    (With training.dtype = "bfloat16" the config resolves 'auto' to 'bfloat16' itself.)"""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@contextmanager
def parameters_in(dtype: torch.dtype):
    """Modules built inside hold parameters of `dtype` (training.dtype): torch's default dtype,
    set for the block and restored after. Buffers that fix their own dtype (the complex RoPE
    table) keep it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def apply_fsdp(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, cpu_offload: bool = False) -> None:
    """Shard each transformer block, then the rest (embeddings, final norm, output) at the root.

    `mesh` is the 1-D shard mesh or the 2-D (replicate, shard) mesh. One FSDP unit per block lets
    the all-gather of block i+1 overlap the compute of block i. Gradients are SUMMED over
    data-parallel ranks (divide factor 1, plain SUM collectives, which every backend has): the
    loss is already divided by the global token count (trainer/loss.py), so averaging again
    would be wrong.
    """
    stored = {p.dtype for p in model.parameters()}
    if any(torch.finfo(param_dtype).bits > torch.finfo(dtype).bits for dtype in stored):
        # Full bfloat16 training must stay bfloat16: the config refuses a wider compute dtype.
        raise ValueError(f"FSDP would cast {sorted(map(str, stored))} parameters up to {param_dtype} for compute")
    policy = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else None,
    )
    policy = {k: v for k, v in policy.items() if v is not None}
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
