"""What each item of a full checkpoint saves and how it loads back (DCP Stateful wrappers).

Every item is keyed by names that do not depend on the parallel layout, so that a checkpoint saved
at one layout loads into any other: parameters under their original names, the optimizer's state
and settings per parameter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.loss_scale import DynamicLossScaler

logger = logging.getLogger(__name__)


def aliased_names(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are another name's tensor (a tied output layer's weight) -> that name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def unwrapped(value):
    """`value` without a torchao weight wrapper: float8 all-gather (trainer/float8.py) holds each
    weight (a DTensor's local shard) in a tensor subclass whose `_tensor` is the high-precision
    weight. A checkpoint saves that plain tensor (sharing its memory, so loading fills the
    weight): the same file with float8 on or off, readable without torchao's classes."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not (type(local).__module__.startswith("torchao.") and isinstance(getattr(local, "_tensor", None), torch.Tensor)):
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return local._tensor


class ModelState(Stateful):
    """The model's (sharded) state dict under its original parameter names, optionally cast.
    A tied weight is saved once, under its parameter name (tok_embeddings.weight): the same key
    in every layout, whichever stages hold it."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype
        self.aliases = aliased_names(model)

    def state_dict(self) -> dict:
        state = {k: unwrapped(v) for k, v in get_model_state_dict(self.model).items() if k not in self.aliases}
        return {k: v.to(self.dtype) for k, v in state.items()} if self.dtype else state

    def load_state_dict(self, state: dict) -> None:
        state = {**state, **{alias: state[name] for alias, name in self.aliases.items()}}
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    """The optimizer's state under parameter names, its hyperparameters too ("flattened": one key
    per parameter, e.g. param_groups.<name>.lr). The nested form keys hyperparameters by group
    index and lists each group's parameter names in one value, which differs between pipeline
    stages; DCP keeps one rank's copy of a key, so a stage resumed with another stage's list
    lost its hyperparameters. Checkpoints of earlier versions are nested: they load as such."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, flattened: bool = True):
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=flattened)

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    # Set by the learning-rate schedule after loading (CheckpointManager._continue_schedule).
    SCHEDULED = ("params", "lr", "initial_lr")

    def load_state_dict(self, state: dict) -> None:
        """Load the moments and step counts; the settings (weight decay, betas, eps) stay this
        run's: the checkpoint restores them per parameter, which would mix groups when
        optimizer.weight_decay_exclude changed, and a changed value in the config should apply.
        `changed` names the settings the checkpoint had otherwise (the caller says so)."""
        configured = [{k: v for k, v in group.items() if k not in self.SCHEDULED} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.options)
        self.changed: set[str] = set()
        for group, settings in zip(self.optimizer.param_groups, configured):
            self.changed |= {key for key, value in settings.items() if group.get(key) != value}
            group.update(settings)


class SchedulerState(Stateful):
    """The LR scheduler's state: how many steps were taken. The peak learning rate stays this
    run's (optimizer.lr): LambdaLR would take the checkpoint's base_lrs, so that a resume with
    another optimizer.lr trained on at the old one; `saved_peak` keeps the checkpoint's for the
    caller to say so. Its per-group lists (base_lrs, _last_lr) are saved once for all ranks, but
    pipeline stages may hold different numbers of parameter groups (a stage without any
    parameter of optimizer.weight_decay_exclude has one); every group follows the same schedule
    from the same peak, so the lists are resized to this rank's groups."""

    PER_GROUP = ("base_lrs", "_last_lr")

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.saved_peak: float | None = None

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        configured = list(self.scheduler.base_lrs)
        self._load(state)
        self.saved_peak = self.scheduler.base_lrs[0] if self.scheduler.base_lrs else None
        self.scheduler.base_lrs = configured
        for group, lr in zip(self.scheduler.optimizer.param_groups, configured):
            group["initial_lr"] = lr  # what LambdaLR reads its base from, had it to rebuild them

    def _load(self, state: dict) -> None:
        groups = len(self.scheduler.optimizer.param_groups)
        state = dict(state)
        for key in self.PER_GROUP:
            values = state.get(key)
            if values is not None and len(values) != groups:
                if len(set(values)) != 1:
                    raise RuntimeError(f"lr_scheduler.{key}: the checkpoint's parameter groups have different "
                                       f"learning rates {values}; this run has {groups} group(s)")
                state[key] = [values[0]] * groups
        self.scheduler.load_state_dict(state)


def optimizer_state_is_nested(keys) -> bool:
    """Whether a checkpoint's optimizer state has the nested form of earlier versions."""
    return any(key.startswith("optimizer.param_groups.0.") for key in keys)


# The loop's own state, saved in every full checkpoint as the `train_state` item.
@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    loss_scaler: DynamicLossScaler | None = None  # float16 runs only: the scale continues on resume

    def state_dict(self) -> dict:
        state = {"step": self.step, "tokens_seen": self.tokens_seen}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
