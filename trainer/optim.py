"""Optimizer, learning-rate schedule and global gradient-norm clipping."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """AdamW or Adam from the [optimizer] section."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    kwargs["foreach"] = cfg.implementation == "foreach"
    kwargs["fused"] = cfg.implementation == "fused"
    optimizer_class = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return optimizer_class(params, **kwargs)


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, decay_ratio: float | None,
              decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak learning rate used by optimizer step `step` (1-based).

    Warmup: step/warmup_steps for steps 1..warmup_steps, so the first step already moves and the
    last warmup step runs at the peak. Then a stable phase at the peak (when decay_ratio < 1),
    then decay to min_lr_factor, reached exactly at the last step.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    after_warmup = max(total_steps - warmup_steps, 1)
    decay_steps = after_warmup if decay_ratio is None else round(decay_ratio * after_warmup)
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor. LambdaLR calls the lambda with the number of steps taken so far,
    so index i holds the factor of optimizer step i + 1."""

    def factor(steps_taken: int) -> float:
        return lr_factor(steps_taken + 1, total_steps=total_steps, warmup_steps=cfg.warmup_steps,
                         decay_ratio=cfg.decay_ratio, decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(parameters, max_norm: float, extra_reduce_groups=()) -> torch.Tensor:
    """Global L2 norm of all gradients, then clip to max_norm when max_norm > 0.

    Sharded (DTensor) gradients are reduced over their mesh, so the norm covers every FSDP and
    TP shard. Parameters split over other process groups that DTensor does not know about
    (pipeline stages) are combined through `extra_reduce_groups`. Returns the norm before clipping.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    for group in extra_reduce_groups:
        squared = norm.pow(2)
        torch.distributed.all_reduce(squared, group=group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm
