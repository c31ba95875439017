"""The dynamic loss scale's update rule, its state and the checks of its keys."""

from __future__ import annotations

import pytest
import torch

from trainer.config.manager import ConfigError, load_config
from trainer.loss_scale import DynamicLossScaler, LossScaleError, build_loss_scaler, unscale_gradients


def test_scale_halves_on_overflow_and_doubles_after_a_quiet_window():
    scaler = DynamicLossScaler(initial=1024, growth_interval=3, minimum=1)
    history = []
    for finite in [False, True, True, True, True, False, True]:
        scaler.update(finite, step=len(history) + 1)
        history.append(scaler.scale)
    assert history == [512, 512, 512, 1024, 1024, 512, 512]
    assert scaler.skipped_steps == 2 and scaler.steps_since_overflow == 1


def test_overflow_at_the_minimum_scale_is_a_diverged_loss():
    scaler = DynamicLossScaler(initial=2, growth_interval=10, minimum=1)
    scaler.update(False, step=1)
    assert scaler.scale == 1
    with pytest.raises(LossScaleError, match=r"step 2: .*smallest loss scale \(training.loss_scale_min = 1\)"):
        scaler.update(False, step=2)


def test_state_round_trips():
    scaler = DynamicLossScaler(initial=256, growth_interval=2, minimum=1)
    for finite in [False, True]:
        scaler.update(finite, step=1)
    copy = DynamicLossScaler(initial=65536, growth_interval=2, minimum=1)
    copy.load_state_dict(scaler.state_dict())
    assert copy.state_dict() == scaler.state_dict() == {"scale": 128.0, "steps_since_overflow": 1, "skipped_steps": 1}


def test_unscaling_divides_every_gradient_and_keeps_overflows():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    params[0].grad = torch.tensor([1024.0, -2048.0, float("inf")])
    params[1].grad = torch.tensor([3.0, 0.0, 1.0])
    unscale_gradients(params, 1024.0)
    assert params[0].grad[:2].tolist() == [1.0, -2.0] and torch.isinf(params[0].grad[2])
    assert params[1].grad.tolist() == [3 / 1024, 0.0, 1 / 1024]


def test_only_float16_is_scaled():
    config = load_config([])
    assert build_loss_scaler(config, torch.bfloat16) is None and build_loss_scaler(config, torch.float32) is None
    assert build_loss_scaler(config, torch.float16).scale == 65536


@pytest.mark.parametrize("args, message", [
    (["--training.loss_scale_initial", "1000"], "training.loss_scale_initial: must be a power of two"),
    (["--training.loss_scale_min", "0"], "training.loss_scale_min: must be a power of two"),
    (["--training.loss_scale_min", "131072"], "training.loss_scale_min: must be <= training.loss_scale_initial"),
    (["--training.loss_scale_growth_interval", "0"], "training.loss_scale_growth_interval: must be >= 1"),
])
def test_bad_loss_scale_keys_are_named(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)
