"""Building this rank's part of the model: on the meta device, parallelized, then materialized;
and the noise controls' perturbation of the initial weights.

Two steps, because the estimator (trainer.estimate) runs the second on fake tensors: the
parallelisms are applied to the model on the meta device (no memory, real device meshes), and
only materializing allocates the weights of this rank.
"""

from __future__ import annotations

import logging

import torch

from trainer import float8
from trainer.models.llama3 import Transformer
from trainer.models.llama3.initialization import copy_global_into, parameter_seed
from trainer.models.llama3.hf_config import configured_model_args
from trainer.parallel import ParallelModel, parallelize
from trainer.parallel.fsdp import DTYPES, parameters_in

logger = logging.getLogger(__name__)



def training_model_args(config):
    """The configured model's shapes, with RoPE tables long enough for training and validation."""
    args = configured_model_args(config.model)
    args.max_seq_len = max(config.training.seq_len, config.validation.seq_len if config.validation.enable else 0)
    return args


def build_on_meta(config, dims, mesh, device: torch.device, model_args) -> ParallelModel:
    """The model built on the meta device with every configured parallelism applied: no full copy
    ever exists. Its parameters are of training.dtype (FSDP keeps what it is given)."""
    with torch.device("meta"), parameters_in(DTYPES[config.training.dtype]):
        model = Transformer(model_args)
    # model.converters: before the parallelisms, which then shard the float8 layers.
    conversion = float8.convert(model, config, dims.dp_shard_cp, device) if float8.enabled(config) else None
    float8.set_onednn(device, float8_on=conversion is not None)
    parallel = parallelize(model, dims, mesh, config, device)
    parallel.float8 = conversion
    if parallel.stage_plan is not None:
        logger.info("pipeline: %s", parallel.stage_plan.describe())
    return parallel


def materialize(parallel: ParallelModel, seed: int, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and draw the initial weights (the same global
    weights whatever the layout, see Transformer.init_weights)."""
    for stage in parallel.stages.values():
        stage.to_empty(device=device)
        stage.init_weights(seed=seed, device=device)
        stage.train()


# Numerics-only noise: a rounding-level perturbation of the weights a run starts from.
#
# Two runs on the same data from the same initial weights that differ only in how they round (a
# different reduction order, another parallel layout, a GPU's nondeterministic kernels) drift apart
# slowly; how far is the yardstick the convergence protocol judges a layout with. Its noise controls
# make that drift on purpose, reproducibly and on any device, by multiplying every initial weight
# matrix by (1 + x) with x uniform in +-k rounding errors of the compute dtype (half its machine
# epsilon). Each parameter's noise is drawn from (seed, parameter name) as a full tensor and
# sharded like the parameter, so a perturbed run is the same perturbed run in every layout.
#
# Vectors (the RMSNorm gains) are left as they are. They start at exactly 1.0, a power of two,
# where the spacing of a low-precision format is twice as wide above as below: perturbed gains
# round to 1.0 or just under it, never over, and every perturbed run would start with slightly
# smaller logits than the control (measured in bfloat16 on the tiny model: step-1 loss 2e-3 lower
# in all of four runs). Noise controls must differ from the control by rounding, not by a bias.


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
