"""The statistical decision rule (protocol.verdict.decision) on simulated control families: it passes
correct sets, fails offsets, drifts and wrong gradient norms, and its error rates and minimum
detectable effect are what it claims, measured over many simulated experiments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.plan.tolerance import Tolerance
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve
from protocol.verdict.decision import judge
from protocol.verdict.results import INCONCLUSIVE, PASS

STEPS = np.arange(1, 301)
BASE_LOSS = 2.5 + 3.5 * np.exp(-STEPS / 60.0)
BASE_NORM = 0.5 + 0.2 * np.exp(-STEPS / 100.0)
NOISE_SD = 5e-4  # of a run's per-step deviation from the common trajectory
TOL = Tolerance(mode="statistical", noise_controls=4)


def ar1(rng, n: int, rho: float, sd: float) -> np.ndarray:
    x = np.empty(n)
    x[0] = rng.normal(0, sd)
    shocks = rng.normal(0, sd * math.sqrt(1 - rho ** 2), n)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + shocks[t]
    return x


def run(rng, name: str, loss_offset=0.0, norm_factor=1.0) -> Curve:
    """One run on the common trajectory: its own autocorrelated rounding noise in both observables."""
    loss = BASE_LOSS + ar1(rng, len(STEPS), 0.9, NOISE_SD) + loss_offset
    norm = BASE_NORM * np.exp(ar1(rng, len(STEPS), 0.9, NOISE_SD)) * norm_factor
    return Curve(name=name, steps=STEPS.tolist(), loss=loss.tolist(), grad_norm=norm.tolist(), source=f"<{name}>")


def family(rng, members: int = 5) -> list[Curve]:
    return [run(rng, "control")] + [run(rng, f"control-noise{k}") for k in range(1, members)]


def test_a_correct_set_passes_and_an_offset_fails_with_its_reason():
    rng = np.random.default_rng(0)
    controls = family(rng)
    comparison = compare(controls, [run(rng, "tp2"), run(rng, "off", loss_offset=0.01)], TOL,
                         expect={"off": "pass"})
    good, off = comparison.results
    assert good.outcome == PASS and good.first_diverging_step is None, good.reason
    assert [o.observable for o in good.observables] == ["loss", "grad_norm"]
    loss = good.observables[0]
    assert loss.dof == 4 and loss.window_steps == 30 and loss.window_first_step == 271
    assert loss.margin == pytest.approx(5 * loss.noise_sd) and not loss.margin_given
    assert abs(loss.diff) < loss.margin and loss.tost_p < 0.05
    assert not off.verdict and off.outcome == "FAIL"
    assert off.reason.startswith("loss: final-window (30 steps from 271) mean diff +1.0")
    assert "noise SD against a bound of" in off.reason
    assert off.first_diverging_step == 1  # 0.01 is outside the noise from the first step
    assert comparison.status == "FAIL"


def test_a_wrong_gradient_norm_fails_where_the_loss_cannot_see_it():
    rng = np.random.default_rng(1)
    result = compare(family(rng), [run(rng, "norm", norm_factor=1.04)], TOL).results[0]
    loss, norm = result.observables
    assert loss.passed and not norm.passed
    assert norm.diff == pytest.approx(math.log(1.04), abs=1e-3)
    assert result.reason.startswith("grad_norm: ") and result.first_diverging_step == 1


def test_a_drift_fails_even_when_the_final_window_is_within_the_margin():
    rng = np.random.default_rng(2)
    controls = family(rng)
    centre = 285.5  # the final window's middle: its mean diff stays near 0
    drift = 8e-6 * (STEPS - centre)  # moves the diff by 2.4e-3 over the run, several margins
    test = run(rng, "drifting")
    test.loss = (np.asarray(test.loss) + drift).tolist()
    loss = compare(controls, [test], TOL).results[0].observables[0]
    assert abs(loss.diff) < loss.margin
    assert loss.drifting and not loss.passed and loss.drift_p < 0.05
    assert loss.slope > 0 and loss.drift > loss.margin
    assert "the diff drifts" in loss.reason
    # The same slope 20 times smaller is significant or not, but moves the diff by less than the margin.
    small = run(rng, "small")
    small.loss = (np.asarray(small.loss) + drift / 20).tolist()
    assert compare(controls, [small], TOL).results[0].observables[0].passed


def test_positive_controls_make_the_plan_inconclusive_when_they_pass():
    rng = np.random.default_rng(3)
    controls = family(rng)
    caught = compare(controls, [run(rng, "tp2"), run(rng, "lr", loss_offset=0.01)], TOL, expect={"lr": "fail"})
    assert caught.status == PASS and caught.results[1].outcome == "FAIL (expected)"
    missed = compare(controls, [run(rng, "tp2"), run(rng, "tiny bug", loss_offset=1e-6)], TOL,
                     expect={"tiny bug": "fail"})
    assert missed.status == INCONCLUSIVE and missed.results[1].outcome == "PASS (expected to fail)"


def test_given_margins_replace_the_derived_ones():
    rng = np.random.default_rng(4)
    controls, test = family(rng), run(rng, "t", loss_offset=0.004)
    assert not compare(controls, [test], TOL).results[0].observables[0].passed
    wide = compare(controls, [test], Tolerance(mode="statistical", loss_margin=0.02)).results[0].observables[0]
    assert wide.margin == 0.02 and wide.margin_given and wide.passed


def test_unusable_families_are_refused():
    rng = np.random.default_rng(5)
    control = run(rng, "control")
    twins = [control, Curve("n1", control.steps, control.loss, control.grad_norm, "<n1>"),
             Curve("n2", control.steps, control.loss, control.grad_norm, "<n2>")]
    with pytest.raises(ValueError, match="bitwise identical to the control"):
        compare(twins, [run(rng, "t")], TOL)
    with pytest.raises(ValueError, match="at least 2 noise controls"):
        compare(twins[:2], [run(rng, "t")], TOL)


def test_a_diverged_or_short_set_fails():
    rng = np.random.default_rng(6)
    controls = family(rng)
    nan = run(rng, "nan")
    nan.loss[149] = math.nan
    result = compare(controls, [nan], TOL).results[0]
    assert not result.verdict and "loss: not finite at step 150" in result.reason
    short = Curve("short", STEPS[:200].tolist(), BASE_LOSS[:200].tolist(), BASE_NORM[:200].tolist(), "<short>")
    result = compare(controls, [short], TOL).results[0]
    assert not result.verdict and "stops at step 200" in result.reason


def window_mean_sd(n: int = 30, rho: float = 0.9, sd: float = NOISE_SD) -> float:
    """Standard deviation of the mean of n consecutive points of AR(1) noise of marginal SD sd."""
    lags = np.arange(1, n)
    return sd * math.sqrt((1 + 2 * np.sum((1 - lags / n) * rho ** lags)) / n)


def simulate(rng, offset: float, experiments: int) -> tuple[float, float]:
    """Fail rate of a set offset by `offset` nats over many simulated experiments, and the mean
    detectable offset the experiments stated (nats)."""
    failures, mdes = 0, []
    for _ in range(experiments):
        rows = np.array([BASE_LOSS + ar1(rng, len(STEPS), 0.9, NOISE_SD) for _ in range(5)])
        test = BASE_LOSS + ar1(rng, len(STEPS), 0.9, NOISE_SD) + offset
        verdict = judge(STEPS, rows, test, "loss", TOL)
        failures += not verdict.passed
        mdes.append(verdict.mde)
    return failures / experiments, float(np.mean(mdes))


def test_error_rates_and_detectable_effect_hold_over_many_experiments():
    """Over 400 simulated experiments each: a correct set fails in at most 5% of them (the rule's
    alpha; its noise estimate is the larger of two, so fewer), an offset of the mean stated
    detectable effect fails in about 80% (its power), and twice that offset nearly always; the
    noise SD estimates a correct set's real spread (that of a 30-step window mean of this noise)."""
    rng = np.random.default_rng(7)
    false_fail, mde = simulate(rng, 0.0, 400)
    assert false_fail <= 0.05
    detected, _ = simulate(rng, mde, 400)
    assert 0.65 <= detected <= 0.95, (mde, detected)
    always, _ = simulate(rng, 2 * mde, 200)
    assert always >= 0.97
    # the stated offset, 3.81 estimated noise SDs with the defaults, in true ones: the larger of two
    # noise estimates is never below the truth on average, and not far above it
    true_sigma = window_mean_sd() * math.sqrt(1 + 1 / 5)
    assert 3.81 * true_sigma < mde < 3.81 * 1.5 * true_sigma
