"""A resumed run trains with its own optimizer and schedule settings, not the checkpoint's: for
every key of [optimizer] and [lr_scheduler] (and training.max_norm), a change on resume is applied
from the next step, exactly as a run configured so would have it after the same steps, and named
in one line with both values. The keys come from the config's own dataclasses, so a new key is
covered here (or this test fails until it is)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.launch import TINY_JOB
from trainer.checkpoint.items import OptimizerState, SchedulerState
from trainer.config.job_config import LRScheduler, Optimizer
from trainer.config.manager import load_config, to_dict
from trainer.optim import build_lr_scheduler, build_optimizer, set_schedule_position, settings_changed

STEPS_SAVED = 3
BASE = ["--training.steps", "8", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0.1",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor", "0.1"]
# One changed value per key of the sections a resumed run takes from its configuration.
CHANGED = {
    "optimizer.name": "Adam", "optimizer.lr": "3e-4", "optimizer.beta1": "0.8", "optimizer.beta2": "0.9",
    "optimizer.eps": "1e-6", "optimizer.weight_decay": "0.01", "optimizer.weight_decay_exclude": "norm,embedding",
    "optimizer.implementation": "for-loop",
    "lr_scheduler.warmup_steps": "1", "lr_scheduler.total_steps": "12", "lr_scheduler.decay_ratio": "0.5",
    "lr_scheduler.decay_type": "cosine", "lr_scheduler.min_lr_factor": "0.2",
    "training.max_norm": "0.5",
}


def test_every_resumed_setting_has_a_change_here():
    keys = {f"optimizer.{f.name}" for f in dataclasses.fields(Optimizer)}
    keys |= {f"lr_scheduler.{f.name}" for f in dataclasses.fields(LRScheduler)}
    assert keys | {"training.max_norm"} == set(CHANGED)


class Tiny(torch.nn.Module):
    """Parameters of every kind weight_decay_exclude tells apart, under the trainer's names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8, bias=False)
        self.output = torch.nn.Linear(8, 16, bias=False)


def built(config):
    model = Tiny()
    optimizer = build_optimizer(model.named_parameters(), config.optimizer)
    return model, optimizer, build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)


def train(model, optimizer, scheduler, steps: int) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        scheduler.step()


def settings(model, optimizer) -> list[dict]:
    """Each parameter group's settings, and which parameters (by name) it holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [{k: v for k, v in group.items() if k != "params"} | {"params": [names[id(p)] for p in group["params"]]}
            for group in optimizer.param_groups]


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_a_setting_changed_on_resume_applies_from_the_next_step(key):
    saved_config = load_config([*TINY_JOB, *BASE])
    model, optimizer, scheduler = built(saved_config)
    train(model, optimizer, scheduler, STEPS_SAVED)
    saved_optimizer = copy.deepcopy(OptimizerState(model, optimizer).state_dict())
    saved_schedule = copy.deepcopy(SchedulerState(scheduler).state_dict())

    config = load_config([*TINY_JOB, *BASE, f"--{key}", CHANGED[key]])
    resumed_model, resumed, resumed_schedule = built(config)
    resumed_model.load_state_dict(model.state_dict())
    OptimizerState(resumed_model, resumed).load_state_dict(saved_optimizer)
    SchedulerState(resumed_schedule).load_state_dict(saved_schedule)
    set_schedule_position(resumed_schedule, resumed_schedule.last_epoch)  # as CheckpointManager does

    # What a run configured so from the start has after the same steps.
    expected_model, expected, expected_schedule = built(config)
    set_schedule_position(expected_schedule, STEPS_SAVED)
    assert type(resumed) is type(expected)
    assert settings(resumed_model, resumed) == settings(expected_model, expected)
    assert resumed_schedule.base_lrs == expected_schedule.base_lrs == [config.optimizer.lr] * len(expected.param_groups)
    assert resumed_schedule.last_epoch == STEPS_SAVED
    for step in range(STEPS_SAVED, 12):  # the schedule from here on is this run's
        assert resumed_schedule.lr_lambdas[0](step) == expected_schedule.lr_lambdas[0](step)
    # The moments came from the checkpoint.
    for (name, p), (_, q) in zip(model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], resumed.state[q]["exp_avg"]), name

    changed = settings_changed(to_dict(saved_config), config)
    assert len(changed) == 1 and changed[0].startswith(f"{key} "), changed


def test_a_changed_training_dtype_is_named():
    """The checkpoint's float32 weights and moments are rounded when a run resumes them in bfloat16."""
    saved = load_config([*TINY_JOB, *BASE])
    config = load_config([*TINY_JOB, *BASE, "--training.dtype", "bfloat16"])
    assert settings_changed(to_dict(saved), config) == ["training.dtype 'float32' -> 'bfloat16'"]


def test_an_unchanged_resume_reports_nothing():
    config = load_config([*TINY_JOB, *BASE])
    assert settings_changed(to_dict(config), config) == []
    # A key the saved record lacks (unset, or newer than the checkpoint) had its default.
    saved = to_dict(config)
    del saved["lr_scheduler"]["decay_type"]
    assert settings_changed(saved, config) == []
