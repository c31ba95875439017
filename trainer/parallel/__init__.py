"""Parallelisms, each in its own module with one apply_* entry point, composed by `parallelize`.

Composition order (each step sees the model the previous one produced):
  1. data parallelism: FSDP2 over the dp_shard mesh (fsdp.py)
"""

from __future__ import annotations

import torch

from trainer.parallel.dims import ParallelDims
from trainer.parallel.fsdp import DTYPES, apply_fsdp, resolve_param_dtype


def parallelize(model: torch.nn.Module, dims: ParallelDims, mesh, config, device: torch.device) -> None:
    """Apply the configured parallelisms to a model built on the meta device, in place."""
    p = config.parallelism
    reshard = p.fsdp_reshard_after_forward
    apply_fsdp(
        model,
        mesh["dp_shard_cp"],
        param_dtype=resolve_param_dtype(config.training.mixed_precision_param, device),
        reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
        reshard_after_forward=reshard == "always" or (reshard == "default" and dims.pp == 1),
        cpu_offload=config.training.enable_cpu_offload,
    )
