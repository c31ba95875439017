"""Statistics of test-set loss curves against the control, and the verdict.

Two ways of judging (see `protocol.tolerance.Tolerance`):

* ``exact``: runs from one seed checkpoint in deterministic mode should agree step by step, so
  every common step's |loss difference| must stay within ``loss_atol`` (and the relative grad-norm
  difference within ``grad_norm_rtol`` when that is set), and the test must log every control step.
* ``statistical``: runs that differ by noise cannot agree step by step. The control is repeated
  with different seeds; the spread of their final-window mean losses measures the noise. A test
  passes when its final-window mean lies within a band of the control's (an equivalence test: a
  large noise band cannot hide a difference the floor would catch, and a small difference is
  not a failure just because it is detectable), and the difference shows no trend that would carry
  it out of the band over the run.

Only numpy is used, so the verdict can be computed wherever the metrics files are.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from protocol.curves import Curve
from protocol.tolerance import Tolerance

logger = logging.getLogger(__name__)


@dataclass
class Alignment:
    """A test curve and its reference on the steps both logged."""

    steps: np.ndarray
    test_loss: np.ndarray
    control_loss: np.ndarray
    test_grad_norm: np.ndarray | None
    control_grad_norm: np.ndarray | None
    missing_in_test: list[int]
    """Control steps the test did not log."""
    missing_in_control: list[int]
    """Test steps the control did not log (ignored by the statistics)."""

    @property
    def diff(self) -> np.ndarray:
        """test - control per common step."""
        return self.test_loss - self.control_loss


@dataclass
class Trend:
    """Least-squares line through the loss difference over steps."""

    slope: float
    """Change of the difference per training step."""
    stderr: float
    z: float
    """slope / stderr; 0 for a zero slope, +-inf for a nonzero slope fitted without residual."""


@dataclass
class SetResult:
    """Statistics and verdict of one test set."""

    name: str
    steps_compared: int
    missing_in_test: list[int]
    missing_in_control: list[int]
    # the test curve on the common steps
    initial_loss: float
    final_loss: float
    min_loss: float
    mean_loss: float
    # the control (exact: the first control run; statistical: the mean of the repeats) on the same steps
    control_initial_loss: float
    control_final_loss: float
    control_min_loss: float
    control_mean_loss: float
    # loss difference, test - control
    max_abs_diff: float
    max_abs_diff_step: int | None
    mean_abs_diff: float
    final_diff: float
    threshold: float
    """|diff| limit used for first_diverging_step: loss_atol (exact) or the band (statistical)."""
    first_diverging_step: int | None
    # gradient norm, |test - control| / |control|
    grad_norm_max_rel_diff: float | None
    grad_norm_max_rel_diff_step: int | None
    grad_norm_first_rel_diff: float | None
    """At the first common step (step 1 for a full run): the earliest sign of a wrong gradient."""
    # final window
    window_steps: int
    window_first_step: int | None
    test_window_mean: float
    control_window_mean: float
    final_window_diff: float
    # trend of the difference
    trend_slope: float
    trend_stderr: float
    trend_z: float
    trend_drift: float
    """|slope| x (last - first common step): how far the trend moves the difference over the run."""
    # statistical mode only
    control_window_means: list[float] | None = None
    """Final-window mean loss of each control repeat."""
    noise_spread: float | None = None
    """Sample standard deviation of control_window_means."""
    band: float | None = None
    verdict: bool = False
    reason: str = ""
    steps: list[int] = field(default_factory=list, repr=False)
    """Common steps, for plots and machine readers."""
    loss_diff: list[float] = field(default_factory=list, repr=False)
    """test - control at each of `steps`."""


@dataclass
class NotCompared:
    """A run of the plan that has no curve to judge: it failed, or never ran. It fails the plan."""

    name: str
    verdict: str
    """"FAILED" (it ran and failed) or "NOT RUN" (skipped, or not run yet)."""
    reason: str


@dataclass
class Comparison:
    """All test sets against one control."""

    control: str
    mode: str
    tolerance: Tolerance
    results: list[SetResult]
    passed: bool
    controls: list[str] = field(default_factory=list)
    """Names of the control runs (several in statistical mode: the seed repeats)."""
    not_compared: list[NotCompared] = field(default_factory=list)
    """Runs of the plan without a curve; any of them makes the comparison fail."""
    note: str = ""
    """Why nothing was compared, when that is so (no control to compare against)."""


# ---------------------------------------------------------------- entry point
def compare(
    control: Curve | list[Curve],
    tests: dict[str, Curve] | list[Curve],
    tolerance: Tolerance,
    not_compared: list[NotCompared] | None = None,
) -> Comparison:
    """Compare each test curve with the control and judge it by `tolerance.mode`.

    A list of control curves holds the seed repeats of the control; exact mode uses the first.
    A dict of tests names each set by its key. `not_compared` lists the plan's runs without a
    curve (failed, not run): they are reported and fail the comparison. Raises ValueError for
    unusable input (bad tolerance, no test set at all, statistical mode with fewer than two
    control curves, duplicate set names).
    """
    problems = tolerance.problems()
    if problems:
        raise ValueError("; ".join(problems))
    controls = [control] if isinstance(control, Curve) else list(control)
    if not controls:
        raise ValueError("no control curve given")
    not_compared = list(not_compared or [])
    test_curves = _named_tests(tests, allow_none=bool(not_compared))
    if tolerance.mode == "exact":
        if len(controls) > 1:
            logger.info("exact mode compares with the first control run %r; %d other(s) ignored",
                        controls[0].name, len(controls) - 1)
        results = [judge_exact(controls[0], t, tolerance) for t in test_curves]
        label = controls[0].name
    else:
        if len(controls) < 2:
            raise ValueError(f"statistical mode needs >= 2 control runs (seed repeats) to measure the noise, "
                             f"got {len(controls)}")
        if len(controls) < tolerance.control_repeats:
            logger.warning("statistical mode: %d control runs, fewer than tolerance.control_repeats = %d",
                           len(controls), tolerance.control_repeats)
        results = [judge_statistical(controls, t, tolerance) for t in test_curves]
        label = mean_curve(controls).name
    return Comparison(control=label, mode=tolerance.mode, tolerance=tolerance, results=results,
                      passed=all(r.verdict for r in results) and not not_compared,
                      controls=[c.name for c in controls], not_compared=not_compared)


def nothing_to_compare(control: str, tolerance: Tolerance, not_compared: list[NotCompared], note: str) -> Comparison:
    """The comparison of a plan whose control has no curve: every set is reported, none judged."""
    return Comparison(control=control, mode=tolerance.mode, tolerance=tolerance, results=[], passed=False,
                      not_compared=not_compared, note=note)


def _named_tests(tests: dict[str, Curve] | list[Curve], allow_none: bool = False) -> list[Curve]:
    if isinstance(tests, dict):
        curves = [Curve(name=key, steps=c.steps, loss=c.loss, grad_norm=c.grad_norm, source=c.source)
                  for key, c in tests.items()]
    else:
        curves = list(tests)
    if not curves and not allow_none:
        raise ValueError("no test set given")
    names = [c.name for c in curves]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"test sets must have distinct names; repeated: {', '.join(duplicates)}")
    return curves


# ---------------------------------------------------------------- building blocks
def align(control: Curve, test: Curve) -> Alignment:
    """Both curves on the steps they share, and the steps only one of them logged."""
    control_at = {s: i for i, s in enumerate(control.steps)}
    test_at = {s: i for i, s in enumerate(test.steps)}
    common = sorted(control_at.keys() & test_at.keys())
    ci = [control_at[s] for s in common]
    ti = [test_at[s] for s in common]
    both_grad = control.grad_norm is not None and test.grad_norm is not None
    return Alignment(
        steps=np.asarray(common, dtype=np.int64),
        test_loss=np.asarray(test.loss, dtype=np.float64)[ti],
        control_loss=np.asarray(control.loss, dtype=np.float64)[ci],
        test_grad_norm=np.asarray(test.grad_norm, dtype=np.float64)[ti] if both_grad else None,
        control_grad_norm=np.asarray(control.grad_norm, dtype=np.float64)[ci] if both_grad else None,
        missing_in_test=sorted(control_at.keys() - test_at.keys()),
        missing_in_control=sorted(test_at.keys() - control_at.keys()),
    )


def mean_curve(controls: list[Curve]) -> Curve:
    """The per-step mean of the control repeats on the steps all of them logged."""
    common = sorted(set.intersection(*(set(c.steps) for c in controls)))
    if not common:
        raise ValueError("the control runs share no logged step: " + ", ".join(c.name for c in controls))
    loss = np.mean([_values_at(c.steps, c.loss, common) for c in controls], axis=0)
    grad = None
    if all(c.grad_norm is not None for c in controls):
        grad = np.mean([_values_at(c.steps, c.grad_norm, common) for c in controls], axis=0).tolist()
    name = f"mean({', '.join(c.name for c in controls)})"
    return Curve(name=name, steps=common, loss=loss.tolist(), grad_norm=grad,
                 source="; ".join(c.source for c in controls))


def _values_at(steps: list[int], values: list[float], wanted: list[int]) -> np.ndarray:
    at = {s: i for i, s in enumerate(steps)}
    return np.asarray([values[at[s]] for s in wanted], dtype=np.float64)


def window_size(n_steps: int, fraction: float) -> int:
    """Steps in the final window: the fewest that cover `fraction` of n_steps, at least 1.

    The small epsilon keeps float products such as 0.1 x 30 = 3.0000000000000004 from rounding up.
    """
    if n_steps == 0:
        return 0
    return min(n_steps, max(1, math.ceil(fraction * n_steps - 1e-9)))


def trend(steps: np.ndarray, diff: np.ndarray) -> Trend:
    """Ordinary least squares of diff on step, with the slope's standard error.

    Fewer than 3 points leave no degree of freedom for the error: the slope is reported with
    stderr NaN and z 0, so the trend neither passes nor fails a set on its own.
    """
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(diff, dtype=np.float64)
    n = len(x)
    if n < 2:
        return Trend(slope=0.0, stderr=math.nan, z=0.0)
    dx = x - x.mean()
    sxx = float(dx @ dx)
    slope = float(dx @ (y - y.mean())) / sxx
    if n < 3:
        return Trend(slope=slope, stderr=math.nan, z=0.0)
    residual = y - y.mean() - slope * dx
    stderr = math.sqrt(float(residual @ residual) / (n - 2) / sxx)
    if stderr == 0.0:
        z = 0.0 if slope == 0.0 else math.copysign(math.inf, slope)
    else:
        z = slope / stderr
    return Trend(slope=slope, stderr=stderr, z=z)


def relative_diff(test: np.ndarray, control: np.ndarray) -> np.ndarray:
    """|test - control| / |control|; 0 where both are 0, inf where only the control is 0."""
    delta = np.abs(test - control)
    scale = np.abs(control)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(scale > 0, delta / np.where(scale > 0, scale, 1.0), np.where(delta == 0, 0.0, np.inf))
    return np.where(np.isnan(test) | np.isnan(control), np.nan, rel)


def _first_beyond(steps: np.ndarray, values: np.ndarray, limit: float) -> int | None:
    """First step whose value is not within limit (NaN counts as beyond: a diverged run)."""
    bad = ~(values <= limit)
    return int(steps[np.argmax(bad)]) if bad.any() else None


def _argmax_step(steps: np.ndarray, values: np.ndarray) -> tuple[float, int | None]:
    """Largest value and its step; NaN wins, since it means a diverged run."""
    if len(values) == 0:
        return math.nan, None
    nan = np.isnan(values)
    i = int(np.argmax(nan)) if nan.any() else int(np.argmax(values))
    return float(values[i]), int(steps[i])


# ---------------------------------------------------------------- statistics
def _statistics(al: Alignment, name: str, fraction: float, threshold: float) -> SetResult:
    """Everything both modes report; verdict and reason are filled in by the caller."""
    steps, diff = al.steps, al.diff
    n = len(steps)
    absdiff = np.abs(diff)
    nan = math.nan
    max_abs, max_step = _argmax_step(steps, absdiff)
    k = window_size(n, fraction)
    grad_max = grad_max_step = grad_first = None
    if al.test_grad_norm is not None and n:
        rel = relative_diff(al.test_grad_norm, al.control_grad_norm)
        grad_max, grad_max_step = _argmax_step(steps, rel)
        grad_first = float(rel[0])
    tr = trend(steps, diff)
    span = float(steps[-1] - steps[0]) if n else 0.0

    def stat(values: np.ndarray, fn) -> float:
        return float(fn(values)) if n else nan

    return SetResult(
        name=name,
        steps_compared=n,
        missing_in_test=al.missing_in_test,
        missing_in_control=al.missing_in_control,
        initial_loss=stat(al.test_loss, lambda v: v[0]),
        final_loss=stat(al.test_loss, lambda v: v[-1]),
        min_loss=stat(al.test_loss, np.min),
        mean_loss=stat(al.test_loss, np.mean),
        control_initial_loss=stat(al.control_loss, lambda v: v[0]),
        control_final_loss=stat(al.control_loss, lambda v: v[-1]),
        control_min_loss=stat(al.control_loss, np.min),
        control_mean_loss=stat(al.control_loss, np.mean),
        max_abs_diff=max_abs,
        max_abs_diff_step=max_step,
        mean_abs_diff=stat(absdiff, np.mean),
        final_diff=stat(diff, lambda v: v[-1]),
        threshold=threshold,
        first_diverging_step=_first_beyond(steps, absdiff, threshold),
        grad_norm_max_rel_diff=grad_max,
        grad_norm_max_rel_diff_step=grad_max_step,
        grad_norm_first_rel_diff=grad_first,
        window_steps=k,
        window_first_step=int(steps[-k]) if k else None,
        test_window_mean=stat(al.test_loss[n - k:], np.mean),
        control_window_mean=stat(al.control_loss[n - k:], np.mean),
        final_window_diff=stat(diff[n - k:], np.mean),
        trend_slope=tr.slope,
        trend_stderr=tr.stderr,
        trend_z=tr.z,
        trend_drift=abs(tr.slope) * span,
        steps=[int(s) for s in steps],
        loss_diff=[float(d) for d in diff],
    )


# ---------------------------------------------------------------- verdicts
def judge_exact(control: Curve, test: Curve, tol: Tolerance) -> SetResult:
    """Every common step within loss_atol (and grad_norm_rtol when set), every control step logged."""
    al = align(control, test)
    result = _statistics(al, test.name, tol.final_window, tol.loss_atol)
    result.verdict, result.reason = _exact_reason(al, result, tol)
    return result


def _exact_reason(al: Alignment, r: SetResult, tol: Tolerance) -> tuple[bool, str]:
    if r.steps_compared == 0:
        return False, "no step in common with the control"
    if r.first_diverging_step is not None:
        step = r.first_diverging_step
        d = float(al.diff[list(r.steps).index(step)])
        return False, f"step {step}: loss diff {d:+.3e} exceeds loss_atol {tol.loss_atol:.3e}"
    if tol.grad_norm_rtol > 0:
        if al.test_grad_norm is None:
            return False, "grad_norm_rtol is set but the test or the control logged no grad norm"
        rel = relative_diff(al.test_grad_norm, al.control_grad_norm)
        step = _first_beyond(al.steps, rel, tol.grad_norm_rtol)
        if step is not None:
            value = float(rel[list(r.steps).index(step)])
            return False, (f"step {step}: grad-norm relative diff {value:.3e} exceeds grad_norm_rtol "
                           f"{tol.grad_norm_rtol:.3e}")
    if r.missing_in_test:
        return False, (f"the test did not log {len(r.missing_in_test)} control step(s), first "
                       f"{r.missing_in_test[0]}")
    return True, (f"max |loss diff| {r.max_abs_diff:.3e} <= loss_atol {tol.loss_atol:.3e} over "
                  f"{r.steps_compared} steps")


def judge_statistical(controls: list[Curve], test: Curve, tol: Tolerance) -> SetResult:
    """Final-window mean within the noise band of the control's, and no significant drift."""
    reference = mean_curve(controls)
    al = align(reference, test)
    n = len(al.steps)
    k = window_size(n, tol.final_window)
    window = [int(s) for s in al.steps[n - k:]]
    means = [float(np.mean(_values_at(c.steps, c.loss, window))) for c in controls] if k else []
    spread = float(np.std(means, ddof=1)) if len(means) >= 2 else math.nan
    control_mean = float(np.mean(means)) if means else math.nan
    band = max(tol.relative_floor * abs(control_mean), tol.noise_multiplier * spread)
    result = _statistics(al, test.name, tol.final_window, band)
    result.control_window_means = means
    result.noise_spread = spread
    result.band = band
    result.verdict, result.reason = _statistical_reason(al, result, reference, tol)
    return result


def _statistical_reason(al: Alignment, r: SetResult, reference: Curve, tol: Tolerance) -> tuple[bool, str]:
    if r.steps_compared == 0:
        return False, "no step in common with the control"
    if r.steps[-1] < reference.steps[-1]:
        # A run that stopped early would otherwise be judged on an earlier, easier window.
        return False, f"the test stops at step {r.steps[-1]}, before the control's last step {reference.steps[-1]}"
    offset = r.test_window_mean - r.control_window_mean
    window = f"final-window ({r.window_steps} steps from {r.window_first_step})"
    if not abs(offset) <= r.band:
        return False, f"{window} mean diff {offset:+.3e} is outside the band +-{r.band:.3e}"
    significant = not abs(r.trend_z) <= tol.trend_z
    if significant and not r.trend_drift <= r.band:
        return False, (f"the diff drifts: slope {r.trend_slope:+.3e}/step (z {r.trend_z:.2f} > {tol.trend_z}) "
                       f"moves it {r.trend_drift:.3e} over the run, more than the band {r.band:.3e}")
    return True, f"{window} mean diff {offset:+.3e} within the band +-{r.band:.3e}; no significant drift"
