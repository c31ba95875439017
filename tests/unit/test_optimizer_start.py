"""The optimizer state created up front (initialize_state) is exactly the state a fresh
optimizer's first step finds: two steps after it equal, bit for bit, two steps of a fresh one,
for every optimizer and implementation the configuration accepts."""

from __future__ import annotations

import typing

import pytest
import torch

from trainer.config.job_config import Optimizer
from trainer.optim import initialize_state, new_optimizer

# Taken from the config's own types, so that an optimizer added there is tested here too.
NAMES = typing.get_args(typing.get_type_hints(Optimizer)["name"])
IMPLEMENTATIONS = typing.get_args(typing.get_type_hints(Optimizer)["implementation"])


def parameters(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    """A matrix, a norm gain and a bias (the kinds weight_decay_exclude tells apart)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"layers.0.attention.wq.weight": (8, 4), "layers.0.attention_norm.weight": (4,), "output.bias": (8,)}
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))) for name, shape in shapes.items()]


def gradients(named, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def two_steps(named, optimizer) -> None:
    for step in range(2):
        gradients(named, step)
        optimizer.step()


def assert_bitwise_equal(named_a, opt_a, named_b, opt_b) -> None:
    for (name, a), (_, b) in zip(named_a, named_b):
        assert torch.equal(a, b), f"{name} differs after two steps"
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key])), f"{name}: state {key}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # training.dtype: the parameters' and state's
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("name", NAMES)
def test_initialized_state_steps_like_a_fresh_optimizer(name, weight_decay, implementation, dtype):
    cfg = Optimizer(name=name, lr=1e-2, weight_decay=weight_decay, implementation=implementation)
    fresh_params, started_params = parameters(dtype), parameters(dtype)
    fresh = new_optimizer(fresh_params, cfg)
    started = new_optimizer(started_params, cfg)
    initialize_state(started)
    assert started.state, "initialize_state created no state"
    two_steps(fresh_params, fresh)
    two_steps(started_params, started)
    assert_bitwise_equal(fresh_params, fresh, started_params, started)


@pytest.mark.parametrize("name", NAMES)
def test_initialized_state_with_an_excluded_group(name):
    """A second group with weight_decay 0 (weight_decay_exclude) keeps its own setting."""
    cfg = Optimizer(name=name, lr=1e-2, weight_decay=0.1, weight_decay_exclude=["norm", "bias"])
    fresh_params, started_params = parameters(), parameters()
    fresh = new_optimizer(fresh_params, cfg)
    started = new_optimizer(started_params, cfg)
    initialize_state(started)
    assert [g["weight_decay"] for g in started.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in started.param_groups] == [1e-2, 1e-2]
    two_steps(fresh_params, fresh)
    two_steps(started_params, started)
    assert_bitwise_equal(fresh_params, fresh, started_params, started)


def test_the_first_step_after_initialize_state_moves_by_the_fresh_amount():
    """Adam's L2 decay at the first step: exp_avg = (1 - beta1) * (grad + wd * p), so the update
    is that of a fresh optimizer whatever initialize_state did before it."""
    cfg = Optimizer(name="Adam", lr=1e-2, weight_decay=0.1, implementation="for-loop")
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = new_optimizer([("w", p)], cfg)
    initialize_state(optimizer)
    p.grad = torch.tensor([0.5, 0.0])
    optimizer.step()
    state = optimizer.state[p]
    decayed = torch.tensor([0.5 + 0.1 * 1.0, 0.0 + 0.1 * -2.0])
    assert torch.allclose(state["exp_avg"], (1 - cfg.beta1) * decayed)
    assert torch.allclose(state["exp_avg_sq"], (1 - cfg.beta2) * decayed ** 2)
    # Bias-corrected: the first Adam step moves each weight by lr against the sign of its gradient.
    assert torch.allclose(p.detach(), torch.tensor([1.0 - 1e-2, -2.0 + 1e-2]), atol=1e-6)
