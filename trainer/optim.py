"""Optimizer, learning-rate schedule and global gradient-norm clipping."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from trainer.config.manager import to_dict
from trainer.local_shards import StepOnLocalShards, scale_gradients_

logger = logging.getLogger(__name__)


class AdamW(StepOnLocalShards, torch.optim.AdamW):
    """torch's AdamW, stepping on the local shards of sharded parameters (trainer/local_shards.py)."""


class Adam(StepOnLocalShards, torch.optim.Adam):
    """torch's Adam, stepping on the local shards of sharded parameters (trainer/local_shards.py)."""


# The optimizers optimizer.name accepts. initialize_state relies on their state starting at zero.
OPTIMIZERS = {"AdamW": AdamW, "Adam": Adam}


def new_optimizer(named_parameters, cfg) -> torch.optim.Optimizer:
    """The optimizer of the [optimizer] section over (name, parameter) pairs, without state yet."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    kwargs["foreach"] = cfg.implementation == "foreach"
    kwargs["fused"] = cfg.implementation == "fused"
    return OPTIMIZERS[cfg.name](param_groups(list(named_parameters), cfg.weight_decay_exclude), **kwargs)


def build_optimizer(named_parameters, cfg) -> torch.optim.Optimizer:
    """AdamW or Adam from the [optimizer] section, over (name, parameter) pairs, with its state
    created (initialize_state)."""
    named = list(named_parameters)
    optimizer = new_optimizer(named, cfg)
    initialize_state(optimizer)
    if cfg.weight_decay_exclude:
        excluded = [n for n, _ in named if parameter_kind(n) in cfg.weight_decay_exclude]
        logger.info("weight decay %g on %d parameters, none on %d (%s)%s", cfg.weight_decay, len(named) - len(excluded),
                    len(excluded), ", ".join(cfg.weight_decay_exclude),
                    "; optimizer.weight_decay is 0, so the exclusion changes nothing" if cfg.weight_decay == 0 else "")
    return optimizer


@torch.no_grad()
def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now, exactly as a fresh first step would find it.

    Saving an optimizer that has no state yet makes torch's distributed state_dict create it by
    running a step with zero gradients at learning rate 0: the weights do not move, but every
    parameter's step count becomes 1, which changes the bias correction of all later steps. That
    happens when a checkpoint is saved before the first optimizer step (a float16 run whose first
    steps overflow). Here the same kind of step runs with every hyperparameter that could move
    the weights or the state neutralised: learning rate 0, and weight decay 0 (Adam's L2 decay
    adds weight_decay x p to the zero gradient, which would leave non-zero moments). Afterwards
    every state tensor is set back to zero (step counts included), which is what a fresh Adam or
    AdamW first step creates (OPTIMIZERS)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params:
        return
    saved = [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, (lr, weight_decay) in zip(optimizer.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, weight_decay
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            else:  # a step count kept as a Python number
                state[key] = 0


# The kinds of parameter optimizer.weight_decay_exclude can name (the type of that key lists them too).
WEIGHT_DECAY_EXCLUDABLE = ("norm", "embedding", "output", "bias")


def parameter_kind(name: str) -> str:
    """What a parameter is, from its original name (the same under every parallel layout):
    'norm' (an RMSNorm gain), 'embedding' (the token embedding), 'output' (the final
    projection to the vocabulary), 'bias', or 'weight' (any other matrix)."""
    module, _, leaf = name.rpartition(".")
    owner = module.rpartition(".")[2]
    if leaf == "bias":
        return "bias"
    if owner.endswith("norm"):  # attention_norm, ffn_norm and the final norm
        return "norm"
    return {"tok_embeddings": "embedding", "output": "output"}.get(owner, "weight")


def param_groups(named_parameters, exclude) -> list:
    """One group of every parameter when nothing is excluded (the optimizer state then has the
    layout of earlier checkpoints), else a decayed group and a group of the excluded kinds with
    weight_decay 0. A pipeline stage that holds none of the excluded kinds (e.g. no embedding)
    gets no empty group: checkpoints map groups by parameter name, and empty ones have none."""
    named = list(named_parameters)
    if not exclude:
        return [p for _, p in named]
    excluded = [p for n, p in named if parameter_kind(n) in exclude]
    decayed = [p for n, p in named if parameter_kind(n) not in exclude]
    groups = [{"params": decayed}, {"params": excluded, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, decay_ratio: float | None,
              decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak learning rate used by optimizer step `step` (1-based).

    Warmup: step/warmup_steps for steps 1..warmup_steps, so the first step already moves and the
    last warmup step runs at the peak. Then a stable phase at the peak (when decay_ratio < 1),
    then decay to min_lr_factor, reached exactly at step total_steps and kept after it. A
    decay_ratio of 0, or one that rounds to no decay step, has no decay phase: the peak is kept
    after warmup, also past total_steps (there is nothing to decay over).
    """
    if step <= warmup_steps:
        return step / warmup_steps
    after_warmup = max(total_steps - warmup_steps, 1)
    decay_steps = after_warmup if decay_ratio is None else round(decay_ratio * after_warmup)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step <= decay_start:
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


def schedule_horizon(cfg, training_steps: int) -> int:
    """The steps the schedule is laid out over: lr_scheduler.total_steps, else training.steps."""
    return training_steps if getattr(cfg, "total_steps", None) is None else cfg.total_steps


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor, over the [lr_scheduler] section's horizon (schedule_horizon).
    LambdaLR calls the lambda with the number of steps taken so far, so index i holds the factor
    of optimizer step i + 1."""
    total_steps = schedule_horizon(cfg, training_steps)

    def factor(steps_taken: int) -> float:
        return lr_factor(steps_taken + 1, total_steps=total_steps, warmup_steps=cfg.warmup_steps,
                         decay_ratio=cfg.decay_ratio, decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_schedule_position(scheduler, steps_taken: int) -> None:
    """Set every parameter group's learning rate to what the schedule gives after `steps_taken`
    optimizer steps (LambdaLR's formula), as if the scheduler had stepped there itself."""
    lrs = [base * factor(steps_taken) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def schedule_change(saved_config: dict, config, steps_done: int) -> str | None:
    """Why the learning rates of steps 1..steps_done would differ under this run's schedule from
    the schedule they were trained with (its horizon or [lr_scheduler] changed), or None."""
    saved_steps = saved_config.get("training", {}).get("steps", config.training.steps)
    # A key missing from the saved record is unset (None is not written) or newer than the record:
    # either way its default, which is what the saving run used.
    saved = {**dataclasses.asdict(type(config.lr_scheduler)()), **(saved_config.get("lr_scheduler") or {})}
    saved_horizon = saved.get("total_steps") or saved_steps
    horizon = schedule_horizon(config.lr_scheduler, config.training.steps)
    now = dataclasses.asdict(config.lr_scheduler)
    if saved_horizon == horizon and saved == now:
        return None

    def factors(total: int, s: dict) -> list[float]:
        return [lr_factor(step, total_steps=total, warmup_steps=s["warmup_steps"], decay_ratio=s.get("decay_ratio"),
                          decay_type=s["decay_type"], min_lr_factor=s["min_lr_factor"])
                for step in range(1, steps_done + 1)]

    before, after = factors(saved_horizon, saved), factors(horizon, now)
    differing = [step for step, (a, b) in enumerate(zip(before, after), 1) if a != b]
    if not differing:
        return None
    return (f"steps {differing[0]}-{steps_done} were trained with the learning-rate schedule of "
            f"{horizon_name(saved.get('total_steps'), saved_steps)}, which differs from this run's "
            f"({horizon_name(config.lr_scheduler.total_steps, config.training.steps)}); steps "
            f"{steps_done + 1}-{config.training.steps} follow this run's schedule, so the curve is not the one of a "
            f"run configured this way from the start (lr_scheduler.total_steps set from the first start fixes the "
            "schedule whatever training.steps is; a stable phase, lr_scheduler.decay_ratio, keeps earlier steps "
            "unchanged while they are before the decay)")


# What a resumed run takes from its configuration, not from the checkpoint it loads: every key of
# these sections (the moments and step counts come from the checkpoint).
RESUMED_SETTINGS = ("optimizer", "lr_scheduler", "training.max_norm")
# Also named when changed on resume: the dtype the checkpoint's weights and optimizer state are
# cast to when loaded (float32 -> bfloat16 rounds them), and float8 layers turned on or off or
# scaled otherwise (the weights load either way: they are kept in high precision).
NAMED_ON_RESUME = (*RESUMED_SETTINGS, "training.dtype", "model.converters", "quantize")


def dotted(table: dict, prefix: str = "") -> dict:
    """A section's keys with the keys of its tables dotted ({"linear": {"float8": {"emulate": x}}}
    -> {"linear.float8.emulate": x})."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_changed(saved_config: dict, config) -> list[str]:
    """'key saved -> now' for every setting of NAMED_ON_RESUME whose value in the configuration
    a checkpoint was saved with (its checkpoint.json) differs from this run's. A key missing
    from the saved configuration (newer than the checkpoint) had its default."""
    now = to_dict(config)
    changed = []
    for name in NAMED_ON_RESUME:
        section, _, key = name.partition(".")
        defaults = dotted(dataclasses.asdict(type(getattr(config, section))()))
        saved = {**defaults, **dotted(saved_config.get(section) or {})}  # None: unset, as a missing section
        current = {**defaults, **dotted(now.get(section, {}))}
        for k in ([key] if key else sorted(current)):
            if saved.get(k) != current.get(k):
                changed.append(f"{section}.{k} {saved.get(k)!r} -> {current.get(k)!r}")
    return changed


def horizon_name(total_steps: int | None, training_steps: int) -> str:
    return f"training.steps = {training_steps}" if total_steps is None else f"lr_scheduler.total_steps = {total_steps}"


@dataclass(frozen=True)
class NormReduction:
    """How the ranks share the gradients: `group` spans every rank (None: a single process), and
    `ranks_per_stage` ranks hold each pipeline stage (world size / PP degree). Every sharded or
    replicated gradient is a DTensor over a mesh of exactly `ranks_per_stage` ranks, which is
    what lets one all-reduce over `group` add each shard once."""

    group: object | None = None
    ranks_per_stage: int = 1
    # Parameters whose gradient another rank holds too (a tied embedding's second copy under
    # pipeline parallelism): clipped like the others, left out of the norm so it counts once.
    duplicates: tuple = ()


def counted_part(tensor, ranks_per_stage: int) -> torch.Tensor | None:
    """This rank's part of `tensor` (a parameter or its gradient) in a sum over every rank that
    counts each element once, or None when another rank counts it.

    A DTensor's local shard counts on the rank at coordinate 0 of each mesh dimension it is
    replicated over (e.g. a norm weight across TP ranks). Plain tensors are whole parameters: they
    only occur without any mesh.
    """
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        if mesh.size() != ranks_per_stage:
            raise RuntimeError(f"a tensor on a mesh of {mesh.size()} ranks, expected {ranks_per_stage}: a global "
                               "norm would count its copies wrongly")
        coordinate = mesh.get_coordinate()
        if any(p.is_replicate() and c != 0 for p, c in zip(tensor.placements, coordinate)):
            return None
        return tensor.to_local()
    if ranks_per_stage == 1:
        return tensor
    raise RuntimeError("a plain-tensor gradient or parameter in a data- or tensor-parallel run: a global norm "
                       "cannot tell how many ranks hold it")


def local_squared_norm(grads, ranks_per_stage: int) -> torch.Tensor:
    """This rank's part of the global sum of squared gradients, in float64 (see counted_part)."""
    device = grads[0].device if grads else torch.device("cpu")
    counted = [part for part in (counted_part(grad, ranks_per_stage) for grad in grads) if part is not None]
    if not counted:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(counted, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def clip_grad_norm(parameters, max_norm: float, reduce: NormReduction = NormReduction()) -> torch.Tensor:
    """Global L2 norm of all gradients, then clip to max_norm when max_norm > 0.

    One all-reduce of one float64 number covers every FSDP, TP and CP shard and every pipeline
    stage (instead of one reduction per mesh dimension and one more over the pipeline), and the
    squares are accumulated in float64 whatever the gradients' dtype. Returns the norm before
    clipping (float64).
    """
    parameters = [p for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if not any(p is d for d in reduce.duplicates)]
    squared = local_squared_norm(counted, reduce.ranks_per_stage)
    if reduce.group is not None:
        torch.distributed.all_reduce(squared, group=reduce.group)
    norm = squared.sqrt()
    if max_norm > 0 and parameters:
        # torch.nn.utils.clip_grads_with_norm_'s factor, applied to the local shards
        factor = torch.clamp(float(max_norm) / (norm.float() + 1e-6), max=1.0)
        scale_gradients_([p.grad for p in parameters], factor)
    return norm
