"""The verdict's blind spots closed: a plan's false-fail rate held at its level over all its sets
(Holm's step-down, protocol.verdict.family_wise), a test set noisier than its controls judged by its own
noise, and float16 steps skipped out of phase left out; each measured over simulated experiments
or shown on curves built to have the case."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from protocol.plan.tolerance import Tolerance
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve, read_curve
from protocol.verdict.family_wise import holm
from protocol.verdict.results import PASS
from tests.protocol.test_decision import BASE_LOSS, BASE_NORM, NOISE_SD, STEPS, TOL, ar1, family, run


def test_holm_steps_down_from_the_smallest_p_value():
    assert holm([0.001, 0.02, 0.04], 0.05) == [(0.05 / 3, True), (0.05 / 2, True), (0.05, True)]
    # the second smallest misses its threshold: it and every larger one stay accepted
    assert holm([0.03, 0.001, 0.2], 0.05) == [(0.025, False), (0.05 / 3, True), (0.05, False)]


def plans_failed(rng, sets: int, experiments: int, tol: Tolerance = TOL, noise_factor: float = 1.0) -> float:
    """Share of simulated plans of `sets` correct sets that fail anywhere."""
    failed = 0
    for _ in range(experiments):
        controls = family(rng)
        tests = [noisy_run(rng, f"set{i}", noise_factor) for i in range(sets)]
        failed += compare(controls, tests, tol).status != PASS
    return failed / experiments


def noisy_run(rng, name: str, factor: float) -> Curve:
    """A correct run whose rounding noise is `factor` times the family's (a kernel of its own)."""
    loss = BASE_LOSS + ar1(rng, len(STEPS), 0.9, NOISE_SD * factor)
    norm = BASE_NORM * np.exp(ar1(rng, len(STEPS), 0.9, NOISE_SD * factor))
    return Curve(name=name, steps=STEPS.tolist(), loss=loss.tolist(), grad_norm=norm.tolist(), source=f"<{name}>")


def test_a_plan_of_many_correct_sets_fails_at_most_at_its_stated_level():
    """200 simulated plans of 6 correct sets (12 judged observables): at most plan_false_fail of
    them fail anywhere, and the report states that bound."""
    rng = np.random.default_rng(10)
    assert plans_failed(rng, 6, 200) <= TOL.plan_false_fail
    comparison = compare(family(rng), [run(rng, f"s{i}") for i in range(6)], TOL)
    assert 0 < comparison.plan_false_fail <= TOL.plan_false_fail
    loss = comparison.results[0].observables[0]
    # the bound applied is never below the margin's own (margin - t sigma = 2.87 sigma)
    assert loss.bound >= 2.86 * loss.noise_sd and loss.holm_threshold <= TOL.plan_false_fail
    assert "plan-level threshold" in loss.reason


def test_positive_controls_still_fail_in_a_plan_of_several_sets():
    """A 1% loss offset and a 4% gradient-norm error beside three correct sets: both caught, the
    correct sets pass, and the plan is PASS."""
    rng = np.random.default_rng(11)
    tests = [run(rng, f"ok{i}") for i in range(3)] + [run(rng, "lr", loss_offset=0.01),
                                                       run(rng, "norm", norm_factor=1.04)]
    comparison = compare(family(rng), tests, TOL, expect={"lr": "fail", "norm": "fail"})
    assert [r.outcome for r in comparison.results] == [PASS] * 3 + ["FAIL (expected)"] * 2
    assert comparison.status == PASS


def test_a_noisier_but_unbiased_set_fails_no_more_often_than_the_stated_level():
    """A correct set with 1.5x the family's rounding noise: judged by its own larger noise it fails
    in at most plan_false_fail of 200 plans (by the family's sigma it would fail more often), and
    its verdict says which noise judged it."""
    rng = np.random.default_rng(12)
    assert plans_failed(rng, 1, 200, noise_factor=1.5) <= TOL.plan_false_fail
    loss = compare(family(rng), [noisy_run(rng, "noisy", 3.0)], TOL).results[0].observables[0]
    assert loss.noise_sd >= loss.family_noise_sd


def test_a_set_far_noisier_than_its_controls_fails_on_its_own_noise():
    """Its own noise is evidence: a set 8x noisier than rounding explains fails in most plans even
    where its curves are within its (widened) bounds, and says so."""
    rng = np.random.default_rng(13)
    results = [compare(family(rng), [noisy_run(rng, "noisy", 8.0)], TOL).results[0] for _ in range(40)]
    assert sum(r.failed for r in results) >= 28
    alone = [r for r in results if r.evidence == ["own noise"]]
    assert alone and all(r.reason.startswith("own noise: its ") and "beyond 5x" in r.reason for r in alone)
    assert all("own noise" in r.evidence for r in results if any(o.noise_ratio > 5 for o in r.observables))


def skipping(curve: Curve, skipped: list[int]) -> Curve:
    """The curve as a float16 run that skipped these steps: no gradient norm there."""
    norms = [math.nan if s in skipped else g for s, g in zip(curve.steps, curve.grad_norm)]
    return Curve(curve.name, curve.steps, curve.loss, norms, curve.source, skipped=sorted(skipped))


def test_float16_steps_skipped_out_of_phase_are_left_out_and_counted():
    """Every run skips the first 3 steps (the scale finding its level) and then one step per
    growth period, each at its own phase: the correct set passes, with the skip counts reported;
    a set that skips far more often fails on that, with its own message."""
    rng = np.random.default_rng(13)
    phases = [[1, 2, 3, *range(40 + 3 * k, 301, 50)] for k in range(5)]
    controls = [skipping(c, skips) for c, skips in zip(family(rng), phases)]
    correct = skipping(run(rng, "tp2"), [1, 2, 3, *range(47, 301, 50)])
    overflowing = skipping(run(rng, "bug"), [1, 2, 3, *range(20, 301, 10)])
    comparison = compare(controls, [correct, overflowing], TOL)
    good, bad = comparison.results
    assert good.outcome == PASS, good.reason
    assert good.skipped_steps == 9 and comparison.family_skips == {c.name: len(p) for c, p in zip(controls, phases)}
    left_out = set().union(*phases, correct.skipped)
    assert good.observables[0].steps == 300 - len(left_out) == 262  # every step any run skipped
    assert not bad.verdict and bad.skipped_steps == 32
    assert "float16 skips: skipped 32 steps for an overflow where the control family skipped 8-9" in bad.reason


def test_a_skipped_step_is_read_from_metrics_jsonl(tmp_path):
    records = [{"step": 1, "loss": 6.0, "grad_norm": None, "step_skipped": True},
               {"step": 2, "loss": 5.9, "grad_norm": 0.5, "step_skipped": False}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    curve = read_curve(tmp_path)
    assert curve.skipped == [1] and math.isnan(curve.grad_norm[0]) and curve.grad_norm[1] == pytest.approx(0.5)
