"""Statistics and verdicts on hand-made curves whose figures are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.compare import align, compare, mean_curve, relative_diff, trend, window_size
from protocol.curves import Curve
from protocol.tolerance import Tolerance

STEPS = list(range(1, 51))


def curve(name, loss, steps=STEPS, grad_norm=None):
    return Curve(name=name, steps=list(steps), loss=[float(v) for v in loss],
                 grad_norm=None if grad_norm is None else [float(g) for g in grad_norm], source=f"<{name}>")


def control_loss(steps=STEPS):
    return [5.0 - 0.01 * s for s in steps]


def control_grad(steps=STEPS):
    return [1.0 + 0.1 * s for s in steps]


EXACT = Tolerance(mode="exact", loss_atol=1e-4)


# ---------------------------------------------------------------- building blocks
def test_window_size_covers_the_fraction():
    assert window_size(50, 0.1) == 5
    assert window_size(30, 0.1) == 3  # 0.1 x 30 is 3.0000000000000004 in floating point
    assert window_size(31, 0.1) == 4
    assert window_size(5, 0.1) == 1  # at least one step
    assert window_size(7, 1.0) == 7
    assert window_size(0, 0.1) == 0


def test_trend_of_known_lines():
    steps = np.arange(1, 11)
    constant = trend(steps, np.full(10, 0.5))
    assert (constant.slope, constant.stderr, constant.z) == (0.0, 0.0, 0.0)
    line = trend(steps, 2.0 * steps)
    assert line.slope == pytest.approx(2.0)
    assert line.stderr == 0.0 and line.z == math.inf
    assert trend(steps, -2.0 * steps).z == -math.inf
    # y = x + (+1, -1, +1, ...): residuals from the fitted line give a textbook standard error
    y = steps + np.where(steps % 2 == 0, -1.0, 1.0)
    x = steps.astype(float)
    slope = np.polyfit(x, y, 1)[0]
    resid = y - np.polyval(np.polyfit(x, y, 1), x)
    se = math.sqrt(resid @ resid / 8 / ((x - x.mean()) @ (x - x.mean())))
    noisy = trend(steps, y)
    assert noisy.slope == pytest.approx(slope)
    assert noisy.stderr == pytest.approx(se)
    assert noisy.z == pytest.approx(slope / se)
    assert math.isnan(trend(steps[:2], np.array([0.0, 1.0])).stderr)


def test_relative_diff_edge_cases():
    rel = relative_diff(np.array([2.0, 0.0, 1.0, math.nan]), np.array([1.0, 0.0, 0.0, 1.0]))
    assert rel[0] == 1.0 and rel[1] == 0.0 and rel[2] == math.inf and math.isnan(rel[3])


def test_align_reports_missing_steps():
    control = curve("c", control_loss())
    test_steps = [s for s in STEPS if s not in (10, 20)] + [51]
    test = curve("t", control_loss(test_steps), steps=test_steps)
    al = align(control, test)
    assert al.missing_in_test == [10, 20]
    assert al.missing_in_control == [51]
    assert len(al.steps) == 48 and 10 not in al.steps
    assert np.allclose(al.diff, 0.0)


def test_mean_curve_uses_steps_common_to_all_repeats():
    a = curve("a", [1.0, 2.0, 3.0], steps=[1, 2, 3], grad_norm=[1.0, 1.0, 1.0])
    b = curve("b", [3.0, 4.0], steps=[2, 3], grad_norm=[3.0, 5.0])
    mean = mean_curve([a, b])
    assert mean.steps == [2, 3]
    assert mean.loss == [2.5, 3.5]
    assert mean.grad_norm == [2.0, 3.0]
    assert mean.name == "mean(a, b)"


# ---------------------------------------------------------------- exact mode
def test_exact_constant_offset_passes_with_known_statistics():
    control = curve("fsdp", control_loss())
    test = curve("tp2", [v + 3e-5 for v in control_loss()])
    comparison = compare(control, [test], EXACT)
    assert comparison.passed and comparison.control == "fsdp" and comparison.mode == "exact"
    r = comparison.results[0]
    assert r.verdict
    assert r.steps_compared == 50 and r.missing_in_test == [] and r.missing_in_control == []
    assert r.max_abs_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.mean_abs_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.final_diff == pytest.approx(3e-5, rel=1e-6)
    assert r.first_diverging_step is None and r.threshold == 1e-4
    assert r.initial_loss == pytest.approx(4.99 + 3e-5)
    assert r.final_loss == pytest.approx(4.5 + 3e-5)
    assert r.min_loss == pytest.approx(4.5 + 3e-5)
    assert r.mean_loss == pytest.approx(4.745 + 3e-5)
    assert (r.control_initial_loss, r.control_final_loss) == pytest.approx((4.99, 4.5))
    assert r.control_min_loss == pytest.approx(4.5) and r.control_mean_loss == pytest.approx(4.745)
    # final window: the last 5 of 50 steps
    assert r.window_steps == 5 and r.window_first_step == 46
    assert r.test_window_mean == pytest.approx(5.0 - 0.01 * 48 + 3e-5)
    assert r.control_window_mean == pytest.approx(5.0 - 0.01 * 48)
    assert r.final_window_diff == pytest.approx(3e-5, rel=1e-6)
    assert abs(r.trend_slope) < 1e-15  # a constant diff has no trend, up to rounding
    assert r.grad_norm_max_rel_diff is None and r.grad_norm_first_rel_diff is None
    assert r.steps == STEPS and r.loss_diff == pytest.approx([3e-5] * 50, rel=1e-6)
    assert "3.000e-05" in r.reason


def test_exact_jump_fails_at_first_diverging_step():
    jumped = [v + (1e-3 if s >= 7 else 0.0) for s, v in zip(STEPS, control_loss())]
    r = compare(curve("fsdp", control_loss()), {"bad": curve("x", jumped)}, EXACT).results[0]
    assert r.name == "bad"
    assert not r.verdict
    assert r.first_diverging_step == 7
    assert r.max_abs_diff == pytest.approx(1e-3, rel=1e-6)
    assert r.mean_abs_diff == pytest.approx(44 / 50 * 1e-3, rel=1e-6)
    assert r.final_diff == pytest.approx(1e-3, rel=1e-6)
    assert "step 7" in r.reason and "+1.000e-03" in r.reason
    # the difference steps up: a positive trend
    assert r.trend_slope > 0


def test_exact_nan_loss_fails_at_the_nan_step():
    diverged = control_loss()
    diverged[29] = math.nan
    r = compare(curve("c", control_loss()), [curve("nan", diverged)], EXACT).results[0]
    assert not r.verdict and r.first_diverging_step == 30 and math.isnan(r.max_abs_diff)
    assert r.max_abs_diff_step == 30


def test_exact_grad_norm_relative_difference():
    control = curve("c", control_loss(), grad_norm=control_grad())
    test = curve("t", control_loss(), grad_norm=[g * (1 + 2e-6) for g in control_grad()])
    report_only = compare(control, [test], EXACT).results[0]
    assert report_only.verdict
    assert report_only.grad_norm_max_rel_diff == pytest.approx(2e-6, rel=1e-6)
    assert report_only.grad_norm_first_rel_diff == pytest.approx(2e-6, rel=1e-6)

    loose = compare(control, [test], Tolerance(mode="exact", grad_norm_rtol=1e-5)).results[0]
    assert loose.verdict
    strict = compare(control, [test], Tolerance(mode="exact", grad_norm_rtol=1e-6)).results[0]
    assert not strict.verdict
    assert "step 1: grad-norm relative diff 2.000e-06" in strict.reason

    # a wrong gradient from step 12 on
    late = [g * (1.5 if s >= 12 else 1.0) for s, g in zip(STEPS, control_grad())]
    r = compare(control, [curve("late", control_loss(), grad_norm=late)],
                Tolerance(mode="exact", grad_norm_rtol=1e-5)).results[0]
    assert not r.verdict and "step 12" in r.reason
    assert r.grad_norm_max_rel_diff == pytest.approx(0.5) and r.grad_norm_first_rel_diff == 0.0

    no_grad = compare(control, [curve("ng", control_loss())], Tolerance(mode="exact", grad_norm_rtol=1e-5))
    assert not no_grad.passed and "no grad norm" in no_grad.results[0].reason


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
    comparison = compare([curve("c0", control_loss()), bad], [good, curve("bad2", bad.loss)], EXACT)
    assert comparison.control == "c0" and comparison.controls == ["c0", "bad"]
    assert [r.verdict for r in comparison.results] == [True, False]
    assert not comparison.passed


def test_no_common_steps_fails():
    r = compare(curve("c", control_loss()), [curve("far", [1.0], steps=[1000])], EXACT).results[0]
    assert not r.verdict and r.steps_compared == 0 and "no step in common" in r.reason


def test_input_errors():
    c = curve("c", control_loss())
    with pytest.raises(ValueError, match="statistical mode needs >= 2 control runs"):
        compare(c, [c], Tolerance(mode="statistical", control_repeats=2))
    with pytest.raises(ValueError, match="repeated: t"):
        compare(c, [curve("t", control_loss()), curve("t", control_loss())], EXACT)
    with pytest.raises(ValueError, match="no test set"):
        compare(c, [], EXACT)
    with pytest.raises(ValueError, match="loss_atol"):
        compare(c, [c], Tolerance(loss_atol=0))


# ---------------------------------------------------------------- statistical mode
STAT = Tolerance(mode="statistical", control_repeats=3, relative_floor=0.01, noise_multiplier=3.0,
                 final_window=0.1, trend_z=2.576)
SPREAD_OFFSETS = (-0.05, 0.0, 0.05)  # the repeats' final-window means: base mean + these


def repeats():
    """Three control seeds: the base curve shifted by -0.05, 0, +0.05 (sample std exactly 0.05)."""
    return [curve(f"seed{i}", [v + off for v in control_loss()]) for i, off in enumerate(SPREAD_OFFSETS)]


def expected_band():
    base_window_mean = 5.0 - 0.01 * 48  # steps 46..50
    spread = float(np.std([base_window_mean + o for o in SPREAD_OFFSETS], ddof=1))
    assert spread == pytest.approx(0.05)
    return max(0.01 * base_window_mean, 3.0 * spread), spread, base_window_mean


def test_statistical_constant_offset_inside_band_passes():
    band, spread, control_mean = expected_band()
    assert band == pytest.approx(0.15)  # the noise term beats the 1% floor (0.0452)
    comparison = compare(repeats(), {"4d": curve("x", [v + 0.1 for v in control_loss()])}, STAT)
    assert comparison.control == "mean(seed0, seed1, seed2)"
    r = comparison.results[0]
    assert r.verdict, r.reason
    assert r.noise_spread == pytest.approx(spread)
    assert r.band == pytest.approx(band) and r.threshold == pytest.approx(band)
    assert r.control_window_means == pytest.approx([control_mean + o for o in SPREAD_OFFSETS])
    assert r.control_window_mean == pytest.approx(control_mean)
    assert r.final_window_diff == pytest.approx(0.1)
    assert r.first_diverging_step is None
    assert abs(r.trend_slope) < 1e-12


def test_statistical_constant_offset_outside_band_fails():
    band, _, _ = expected_band()
    r = compare(repeats(), [curve("3d", [v + 0.2 for v in control_loss()])], STAT).results[0]
    assert not r.verdict
    assert r.first_diverging_step == 1  # the band is the per-step threshold too
    assert "outside the band" in r.reason and "+2.000e-01" in r.reason
    negative = compare(repeats(), [curve("3d", [v - 0.2 for v in control_loss()])], STAT).results[0]
    assert not negative.verdict and negative.final_window_diff == pytest.approx(-0.2)


def test_statistical_floor_sets_the_band_when_seeds_agree():
    tight = [curve(f"s{i}", [v + off for v in control_loss()]) for i, off in enumerate((-1e-4, 0.0, 1e-4))]
    control_mean = 5.0 - 0.01 * 48
    r = compare(tight, [curve("t", [v + 0.04 for v in control_loss()])], STAT).results[0]
    assert r.noise_spread == pytest.approx(1e-4)
    assert r.band == pytest.approx(0.01 * control_mean)  # 0.0452 > 3 x 1e-4
    assert r.verdict
    assert not compare(tight, [curve("t", [v + 0.05 for v in control_loss()])], STAT).results[0].verdict


def test_statistical_linear_drift_fails_on_trend():
    band, _, _ = expected_band()
    rng = np.random.default_rng(0)
    slope = 0.005
    # centred so that the final-window mean diff (22.5 x slope = 0.1125) is inside the band, while
    # the drift over the run (49 x slope = 0.245) is not
    diff = slope * (np.asarray(STEPS) - 25.5) + rng.normal(0.0, 1e-3, len(STEPS))
    test = curve("drift", np.asarray(control_loss()) + diff)
    r = compare(repeats(), [test], STAT).results[0]
    assert abs(r.final_window_diff) <= band
    assert r.trend_slope == pytest.approx(slope, rel=0.05)
    assert r.trend_z > 100
    assert r.trend_drift == pytest.approx(abs(r.trend_slope) * 49)
    assert not r.verdict
    assert "drifts" in r.reason
    # the same drift, but too small to leave the band over the run: passes although significant
    small = curve("small", np.asarray(control_loss()) + 0.1 * diff)
    r_small = compare(repeats(), [small], STAT).results[0]
    assert abs(r_small.trend_z) > STAT.trend_z and r_small.trend_drift < band
    assert r_small.verdict, r_small.reason


def test_statistical_noise_without_trend_passes():
    rng = np.random.default_rng(1)
    test = curve("noisy", np.asarray(control_loss()) + 0.02 + rng.normal(0.0, 0.01, len(STEPS)))
    r = compare(repeats(), [test], STAT).results[0]
    assert abs(r.trend_z) <= STAT.trend_z
    assert r.verdict, r.reason


def test_statistical_run_that_stops_early_fails():
    short = curve("short", control_loss(range(1, 41)), steps=range(1, 41))
    r = compare(repeats(), [short], STAT).results[0]
    assert not r.verdict and "stops at step 40" in r.reason
    assert r.missing_in_test == list(range(41, 51))
