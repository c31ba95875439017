"""Numerics-only noise: a rounding-level perturbation of the weights a run starts from.

Two runs on the same data from the same initial weights that differ only in how they round (a
different reduction order, another parallel layout, a GPU's nondeterministic kernels) drift apart
slowly; how far is the yardstick the convergence protocol judges a layout with. Its noise controls
make that drift on purpose, reproducibly and on any device, by multiplying every initial weight
matrix by (1 + x) with x uniform in +-k rounding errors of the compute dtype (half its machine
epsilon). Each parameter's noise is drawn from (seed, parameter name) as a full tensor and
sharded like the parameter, so a perturbed run is the same perturbed run in every layout.

Vectors (the RMSNorm gains) are left as they are. They start at exactly 1.0, a power of two,
where the spacing of a low-precision format is twice as wide above as below: perturbed gains
round to 1.0 or just under it, never over, and every perturbed run would start with slightly
smaller logits than the control (measured in bfloat16 on the tiny model: step-1 loss 2e-3 lower
in all of four runs). Noise controls must differ from the control by rounding, not by a bias.
"""

from __future__ import annotations

import logging

import torch

from trainer.models.llama3.model import copy_global_into, parameter_seed

logger = logging.getLogger(__name__)


def rounding_error(dtype: torch.dtype) -> float:
    """The largest relative rounding error of `dtype`: half its machine epsilon (2^-8 for bfloat16)."""
    return torch.finfo(dtype).eps / 2


@torch.no_grad()
def perturb_weights(model: torch.nn.Module, rounding_errors: float, compute_dtype: torch.dtype, seed: int) -> float:
    """Multiply every weight matrix by (1 + x), x ~ U(-r, r) with r = rounding_errors x the
    compute dtype's rounding error; returns r. The noise of a parameter depends only on (seed,
    its name); vectors are not perturbed (see the module docstring)."""
    relative = rounding_errors * rounding_error(compute_dtype)
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        generator = torch.Generator(device=param.device).manual_seed(parameter_seed(seed, f"perturb:{name}"))
        noise = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        noise.uniform_(-relative, relative, generator=generator)
        factor = torch.empty_like(param)
        copy_global_into(factor, noise.add_(1.0).to(param.dtype))
        param.mul_(factor)
    logger.info("initial weight matrices perturbed by up to %.3g relative (%g rounding errors of %s, seed %d)",
                relative, rounding_errors, str(compute_dtype).removeprefix("torch."), seed)
    return relative
