"""Exact-mode verdicts and the figures every set reports, on hand-made curves whose numbers are
known (the statistical rule: test_decision.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.plan.tolerance import Tolerance
from protocol.verdict.alignment import common_steps, relative_diff
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve
from protocol.verdict.statistical_mode import family_mean

STEPS = list(range(1, 51))


def curve(name, loss, steps=STEPS, grad_norm=None):
    return Curve(name=name, steps=list(steps), loss=[float(v) for v in loss],
                 grad_norm=None if grad_norm is None else [float(g) for g in grad_norm], source=f"<{name}>")


def control_loss(steps=STEPS):
    return [5.0 - 0.01 * s for s in steps]


def control_grad(steps=STEPS):
    return [1.0 + 0.1 * s for s in steps]


EXACT = Tolerance(mode="exact", loss_atol=1e-4)  # grad_norm_rtol 1e-5, the default


# ---------------------------------------------------------------- building blocks
def test_relative_diff_edge_cases():
    rel = relative_diff(np.array([2.0, 0.0, 1.0, math.nan]), np.array([1.0, 0.0, 0.0, 1.0]))
    assert rel[0] == 1.0 and rel[1] == 0.0 and rel[2] == math.inf and math.isnan(rel[3])


def test_missing_steps_are_reported_on_both_sides():
    control = curve("c", control_loss())
    test_steps = [s for s in STEPS if s not in (10, 20)] + [51]
    test = curve("t", control_loss(test_steps), steps=test_steps)
    r = compare(control, [test], EXACT).results[0]
    assert r.missing_in_test == [10, 20] and r.missing_in_control == [51]
    assert r.steps_compared == 48 and 10 not in r.steps and r.max_abs_diff == 0.0
    assert common_steps([control, test]) == r.steps


def test_family_mean_uses_steps_common_to_all_runs():
    a = curve("a", [1.0, 2.0, 3.0], steps=[1, 2, 3], grad_norm=[1.0, 1.0, 1.0])
    b = curve("b", [3.0, 4.0], steps=[2, 3], grad_norm=[4.0, 9.0])
    mean = family_mean([a, b])
    assert mean.steps == [2, 3]
    assert mean.loss == [2.5, 3.5]
    assert mean.grad_norm == pytest.approx([2.0, 3.0])  # geometric: the rule compares log norms
    assert mean.name == "mean(a, b)"


# ---------------------------------------------------------------- exact mode
def test_exact_constant_offset_passes_with_known_statistics():
    control = curve("fsdp", control_loss())
    test = curve("tp2", [v + 3e-5 for v in control_loss()])
    comparison = compare(control, [test], EXACT)
    assert comparison.passed and comparison.control == "fsdp" and comparison.mode == "exact"
    assert comparison.design == "exact" and comparison.status == "PASS"
    r = comparison.results[0]
    assert r.verdict and r.outcome == "PASS"
    assert r.steps_compared == 50 and r.missing_in_test == [] and r.missing_in_control == []
    assert r.max_abs_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.mean_abs_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.final_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.first_diverging_step is None
    assert r.initial_loss == pytest.approx(4.99 + 3e-5)
    assert r.final_loss == pytest.approx(4.5 + 3e-5)
    assert (r.control_initial_loss, r.control_final_loss) == pytest.approx((4.99, 4.5))
    assert r.final_window_diff == pytest.approx(3e-5, rel=1e-6)  # the last 5 of 50 steps
    assert r.grad_norm_max_rel_diff is None and r.grad_norm_first_rel_diff is None
    assert r.steps == STEPS and r.loss_diff == pytest.approx([3e-5] * 50, rel=1e-6)
    assert "3.000e-05" in r.reason


def test_exact_jump_fails_at_first_diverging_step():
    jumped = [v + (1e-3 if s >= 7 else 0.0) for s, v in zip(STEPS, control_loss())]
    r = compare(curve("fsdp", control_loss()), [curve("bad", jumped)], EXACT).results[0]
    assert r.name == "bad"
    assert not r.verdict
    assert r.first_diverging_step == 7
    assert r.max_abs_diff == pytest.approx(1e-3, rel=1e-6)
    assert r.mean_abs_diff == pytest.approx(44 / 50 * 1e-3, rel=1e-6)
    assert r.final_diff == pytest.approx(1e-3, rel=1e-6)
    assert "step 7" in r.reason and "+1.000e-03" in r.reason


def test_exact_nan_loss_fails_at_the_nan_step():
    diverged = control_loss()
    diverged[29] = math.nan
    r = compare(curve("c", control_loss()), [curve("nan", diverged)], EXACT).results[0]
    assert not r.verdict and r.first_diverging_step == 30 and math.isnan(r.max_abs_diff)
    assert r.max_abs_diff_step == 30


def test_exact_grad_norm_relative_difference():
    control = curve("c", control_loss(), grad_norm=control_grad())
    test = curve("t", control_loss(), grad_norm=[g * (1 + 2e-6) for g in control_grad()])
    report_only = compare(control, [test], Tolerance(mode="exact", grad_norm_rtol=0)).results[0]
    assert report_only.verdict
    assert report_only.grad_norm_max_rel_diff == pytest.approx(2e-6, rel=1e-6)
    assert report_only.grad_norm_first_rel_diff == pytest.approx(2e-6, rel=1e-6)

    default = compare(control, [test], EXACT).results[0]  # grad_norm_rtol 1e-5 by default
    assert default.verdict and EXACT.grad_norm_rtol == 1e-5
    strict = compare(control, [test], Tolerance(mode="exact", grad_norm_rtol=1e-6)).results[0]
    assert not strict.verdict
    assert "step 1: grad-norm relative diff 2.000e-06" in strict.reason

    # a wrong gradient from step 12 on
    late = [g * (1.5 if s >= 12 else 1.0) for s, g in zip(STEPS, control_grad())]
    r = compare(control, [curve("late", control_loss(), grad_norm=late)],
                Tolerance(mode="exact", grad_norm_rtol=1e-5)).results[0]
    assert not r.verdict and "step 12" in r.reason
    assert r.grad_norm_max_rel_diff == pytest.approx(0.5) and r.grad_norm_first_rel_diff == 0.0

    one_sided = compare(control, [curve("ng", control_loss())], EXACT)
    assert not one_sided.passed and "only one of the test and the control logged a grad norm" in \
        one_sided.results[0].reason
    neither = compare(curve("c", control_loss()), [curve("ng", control_loss())], EXACT).results[0]
    assert neither.verdict and "no grad norm logged, so it was not judged" in neither.reason
    # A TP-only bug that halves one norm weight's gradient barely moves the loss but shows in the
    # norm: the exact verdict judges it by default.
    slightly = [g * (1 + 1.6e-5) for g in control_grad()]
    assert not compare(control, [curve("tp", control_loss(), grad_norm=slightly)], EXACT).passed


def test_exact_missing_steps_fail_coverage():
    control = curve("c", control_loss())
    test_steps = [s for s in STEPS if s not in (10, 20)] + [51]
    test = curve("holes", control_loss(test_steps), steps=test_steps)
    r = compare(control, [test], EXACT).results[0]
    assert not r.verdict
    assert r.missing_in_test == [10, 20] and r.missing_in_control == [51]
    assert r.steps_compared == 48 and r.max_abs_diff == 0.0
    assert "2 control step(s), first 10" in r.reason


def test_exact_uses_the_first_control_and_overall_verdict():
    good = curve("good", control_loss())
    bad = curve("bad", [v + 1.0 for v in control_loss()])
    comparison = compare([curve("c0", control_loss()), bad], [good, curve("bad2", bad.loss)], EXACT,
                         warnings=["not fp32"])
    assert comparison.control == "c0" and comparison.controls == ["c0", "bad"]
    assert [r.verdict for r in comparison.results] == [True, False]
    assert not comparison.passed and comparison.status == "FAIL" and comparison.warnings == ["not fp32"]


def test_no_common_steps_fails():
    r = compare(curve("c", control_loss()), [curve("far", [1.0], steps=[1000])], EXACT).results[0]
    assert not r.verdict and r.steps_compared == 0 and "no step in common" in r.reason


def test_input_errors():
    c = curve("c", control_loss())
    with pytest.raises(ValueError, match="at least 2 noise controls"):
        compare([c, c], [c], Tolerance(mode="statistical"))
    with pytest.raises(ValueError, match="repeated: t"):
        compare(c, [curve("t", control_loss()), curve("t", control_loss())], EXACT)
    with pytest.raises(ValueError, match="no test set"):
        compare(c, [], EXACT)
    with pytest.raises(ValueError, match="loss_atol"):
        compare(c, [c], Tolerance(loss_atol=0))
