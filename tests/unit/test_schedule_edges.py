"""The learning-rate schedule at its edge values, evaluated at every step (and past the last one,
where the scheduler steps once more at the end of a run), and the refusals of impossible
[lr_scheduler] values before launch."""

from __future__ import annotations

import itertools
import math
import typing

import pytest
import torch

from trainer.config.job_config import LRScheduler
from trainer.config.manager import ConfigError, load_config
from trainer.optim import build_lr_scheduler, lr_factor
from trainer.preflight.checks import main as preflight_main

DECAY_TYPES = typing.get_args(typing.get_type_hints(LRScheduler)["decay_type"])
PEAK = 0.01


def schedule(steps: int, warmup: int, ratio, kind: str = "linear", floor: float = 0.0) -> list[float]:
    """Learning rates of optimizer steps 1..steps + 2, as the scheduler of a run sets them (it
    steps after every optimizer step, the last one included)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=PEAK)
    cfg = LRScheduler(warmup_steps=warmup, decay_ratio=ratio, decay_type=kind, min_lr_factor=floor)
    scheduler = build_lr_scheduler(optimizer, cfg, steps)
    lrs = []
    for _ in range(steps + 2):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


def decay_steps(steps: int, warmup: int, ratio) -> int:
    after_warmup = max(steps - warmup, 1)
    return after_warmup if ratio is None else round(ratio * after_warmup)


STEPS = (1, 2, 12)
WARMUPS = (0, 1, 3, 12, 20)  # 12 and 20: warmup = steps, and longer than the schedule
# 0 and 1; 0.04 and 0.06 of 10 post-warmup steps round to 0 and 1 decay step; None: all of them.
RATIOS = (0.0, 0.04, 0.06, 0.5, 1.0, None)
FLOORS = (0.0, 0.1, 1.0)
GRID = [case for case in itertools.product(STEPS, WARMUPS, RATIOS, DECAY_TYPES, FLOORS) if case[1] <= 12]
GRID += [(12, 20, ratio, "linear", 0.1) for ratio in RATIOS]


@pytest.mark.parametrize("steps, warmup, ratio, kind, floor", GRID)
def test_every_step_has_a_finite_rate_between_floor_and_peak(steps, warmup, ratio, kind, floor):
    lrs = schedule(steps, warmup, ratio, kind, floor)  # raises nothing, at any step
    assert all(math.isfinite(lr) for lr in lrs)
    warming, after = lrs[:warmup], lrs[warmup:]
    # Warmup rises from peak/warmup to the peak; after it, the rate stays within [floor, peak] and never rises.
    assert warming == pytest.approx([PEAK * s / warmup for s in range(1, len(warming) + 1)], rel=1e-12)
    assert all(PEAK * floor - 1e-15 <= lr <= PEAK for lr in after)
    assert all(a >= b for a, b in zip(after, after[1:]))
    if warmup >= steps:
        return  # the run ends during warmup (at the peak when warmup = steps)
    decaying = decay_steps(steps, warmup, ratio)
    first, last = lrs[warmup], lrs[steps - 1]
    if decaying == 0:  # no decay phase: the peak from the end of warmup on, also past the last step
        assert after == [PEAK] * len(after)
    else:
        assert last == pytest.approx(PEAK * floor, abs=1e-15)  # the floor, reached at the last step
        assert lrs[steps:] == pytest.approx([PEAK * floor] * 2, abs=1e-15)  # and kept after it
        stable = steps - warmup - decaying
        assert first == (PEAK if stable else pytest.approx(lr_at(1, decaying, kind, floor), abs=1e-15))
        assert sum(lr < PEAK for lr in after[:steps - warmup]) == (decaying if floor < 1 else 0)


def lr_at(k: int, decaying: int, kind: str, floor: float) -> float:
    """The rate of the k-th of `decaying` decay steps."""
    progress = k / decaying
    remaining = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
                 "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]
    return PEAK * (floor + (1 - floor) * remaining)


@pytest.mark.parametrize("steps, warmup, ratio, expected", [
    # decay_ratio 0: warmup, then the peak to the end and beyond (a constant learning rate).
    (6, 2, 0.0, [0.5, 1, 1, 1, 1, 1, 1, 1]),
    (3, 0, 0.0, [1, 1, 1, 1, 1]),
    # 0.04 of 10 steps rounds to no decay step; 0.06 to one (the last step, at the floor).
    (12, 2, 0.04, [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    (12, 2, 0.06, [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0.1, 0.1, 0.1]),
    # decay_ratio 1: decay over every step after warmup.
    (6, 2, 1.0, [0.5, 1, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1]),
    # warmup = steps: the last step runs at the peak; the decay of one step lies past the run.
    (4, 4, None, [0.25, 0.5, 0.75, 1, 0.1, 0.1]),
    (4, 4, 0.0, [0.25, 0.5, 0.75, 1, 1, 1]),
    # one step: without warmup it is the last step of the decay, at the floor; with warmup, the peak.
    (1, 0, None, [0.1, 0.1, 0.1]),
    (1, 0, 0.0, [1, 1, 1]),
    (1, 1, None, [1, 0.1, 0.1]),
])
def test_edge_schedules_step_by_step(steps, warmup, ratio, expected):
    assert schedule(steps, warmup, ratio, "linear", 0.1) == pytest.approx([PEAK * f for f in expected], rel=1e-12)


def test_no_decay_ignores_the_decay_type_and_floor():
    for kind in DECAY_TYPES:
        assert [lr_factor(s, total_steps=5, warmup_steps=1, decay_ratio=0.0, decay_type=kind, min_lr_factor=0.3)
                for s in range(1, 9)] == [1.0] * 8


@pytest.mark.parametrize("option, value, named", [
    ("--lr_scheduler.warmup_steps", "-1", "lr_scheduler.warmup_steps: must be >= 0, got -1"),
    ("--lr_scheduler.decay_ratio", "1.5", "lr_scheduler.decay_ratio: must be in [0, 1]"),
    ("--lr_scheduler.decay_ratio", "-0.1", "lr_scheduler.decay_ratio: must be in [0, 1]"),
    ("--lr_scheduler.decay_ratio", "nan", "lr_scheduler.decay_ratio: must be in [0, 1]"),
    ("--lr_scheduler.min_lr_factor", "1.01", "lr_scheduler.min_lr_factor: must be in [0, 1], got 1.01"),
    ("--lr_scheduler.min_lr_factor", "-0.5", "lr_scheduler.min_lr_factor: must be in [0, 1], got -0.5"),
    ("--lr_scheduler.min_lr_factor", "inf", "lr_scheduler.min_lr_factor: must be in [0, 1], got inf"),
    ("--lr_scheduler.total_steps", "0", "lr_scheduler.total_steps: must be >= 1"),
    ("--lr_scheduler.decay_type", "exponential", "choose one of 'linear', 'sqrt', 'cosine'"),
    ("--lr_scheduler.warmup_steps", "2.5", "--lr_scheduler.warmup_steps: expected an integer"),
])
def test_impossible_schedule_values_are_refused_before_launch(capsys, option, value, named):
    assert preflight_main(["--nproc", "1", "--device", "cpu", "--model.flavor", "tiny", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err


def test_decay_ratio_refusal_says_what_0_means():
    with pytest.raises(ConfigError, match=r"0 keeps the peak learning rate\) or unset"):
        load_config(["--lr_scheduler.decay_ratio", "2"])


@pytest.mark.parametrize("options", [
    ["--lr_scheduler.decay_ratio", "0"], ["--lr_scheduler.decay_ratio", "1"],
    ["--lr_scheduler.warmup_steps", "0"], ["--lr_scheduler.min_lr_factor", "1"],
    ["--lr_scheduler.warmup_steps", "50", "--training.steps", "10"],  # longer than the run: the peak is never reached
])
def test_edge_values_that_work_are_accepted(capsys, options):
    assert preflight_main(["--nproc", "1", "--device", "cpu", "--model.flavor", "tiny", *options]) == 0
