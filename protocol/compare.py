"""Test-set curves against the control: the per-set numbers and the plan's verdict.

* ``exact``: runs from one seed checkpoint in deterministic fp32 should agree step by step, so
  every common step's |loss difference| must stay within ``loss_atol`` and the relative
  grad-norm difference within ``grad_norm_rtol`` (when > 0), and the test must log every
  control step.
* ``statistical``: every judged observable of a set is paired step by step with the control
  family (the control and its noise controls, on identical data) and judged by the rule of
  protocol.decision: equivalence of the final-window mean within a margin, and no drift.

Sets may be positive controls (``expect = "fail"``, e.g. a learning rate 5% off): they must fail.
One that passes shows that the plan could not have caught a bug of that size, and the plan is
INCONCLUSIVE rather than PASS. A set that fails where it should pass, or a run that failed,
makes it FAIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from protocol.curves import Curve
from protocol.decision import (ObservableVerdict, detectable_if_noisier, false_fail_chance, judge, margin_for,
                               minimum_detectable_effect, noise_sd)
from protocol.statistics import window_size
from protocol.tolerance import Tolerance

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
DESIGNS = ("exact", "paired", "unpaired")
# Points of the run (fractions of its steps) at which the noise controls' paired difference is
# reported, to show how rounding noise grows with steps.
GROWTH_POINTS = (0.01, 0.1, 0.25, 0.5, 1.0)


@dataclass
class SetResult:
    """Numbers and verdict of one test set. The loss figures compare it with the reference: the
    control (exact mode) or the control family's mean (statistical)."""

    name: str
    expect: str
    """"pass", or "fail" for a positive control."""
    steps_compared: int
    missing_in_test: list[int]
    missing_in_control: list[int]
    initial_loss: float
    final_loss: float
    control_initial_loss: float
    control_final_loss: float
    max_abs_diff: float
    max_abs_diff_step: int | None
    mean_abs_diff: float
    final_diff: float
    final_window_diff: float
    grad_norm_max_rel_diff: float | None
    grad_norm_first_rel_diff: float | None
    """At the first common step (step 1 for a full run): the earliest sign of a wrong gradient."""
    lr_max_rel_diff: float | None
    """Largest relative learning-rate difference: the schedule, which a layout must not change."""
    first_diverging_step: int | None
    """exact: first step beyond loss_atol; statistical: first step a failing observable leaves the
    noise envelope for good. None for a passing set."""
    observables: list[ObservableVerdict] = field(default_factory=list)
    """statistical: one verdict per judged observable."""
    failed: bool = True
    reason: str = ""
    steps: list[int] = field(default_factory=list, repr=False)
    loss_diff: list[float] = field(default_factory=list, repr=False)
    """test - reference loss at each of `steps`."""
    grad_norm_diff: list[float] = field(default_factory=list, repr=False)
    """test / reference grad norm - 1 at each of `steps` (empty without grad norms)."""
    label: str = ""
    """The outcome in other words, when a [criterion] judged the set as a point of a sweep
    ("meets criterion" / "misses criterion": a measurement, not a pass or a failure)."""

    @property
    def verdict(self) -> bool:
        """True when the set passed its judgement (a positive control that passes is True too)."""
        return not self.failed

    @property
    def outcome(self) -> str:
        """PASS, FAIL, 'FAIL (expected)' for a positive control that failed, 'PASS (expected to
        fail)' for one that did not."""
        if self.label:
            return self.label
        if self.expect == "fail":
            return "FAIL (expected)" if self.failed else "PASS (expected to fail)"
        return FAIL if self.failed else PASS


@dataclass
class NotCompared:
    """A run of the plan that has no curve to judge: it failed, or never ran. It fails the plan."""

    name: str
    verdict: str
    """"FAILED" (it ran and failed), "NOT RUN" (skipped, or not run yet) or "STOPPED" (an early-stop
    rule ended it; the reason names the rule and the value that broke it)."""
    reason: str


@dataclass
class NoiseSummary:
    """What the control family says about rounding noise, per judged observable."""

    observable: str
    noise_sd: float
    """Standard deviation of a correct set's final-window difference."""
    margin: float
    mde: float
    """Minimum detectable final-window offset (see protocol.decision)."""
    mde_if_noisier: float
    """The same if the true noise SD were at the upper 95% bound of its estimate."""
    false_fail: float
    """At most the chance that a correct set fails this observable's equivalence test."""
    member_diffs: dict[str, float]
    """Each family member's final-window mean minus the family's."""
    growth: list[tuple[int, float]]
    """(step, RMS over noise controls of their paired difference from the control, averaged over
    the steps around it): how the rounding noise grows."""


@dataclass
class Comparison:
    """All test sets against one control."""

    control: str
    mode: str
    design: str
    """"exact", "paired" (statistical, every run on the same data) or "unpaired"."""
    tolerance: Tolerance
    results: list[SetResult]
    status: str
    """PASS, FAIL or INCONCLUSIVE."""
    controls: list[str] = field(default_factory=list)
    """The control family: the control, then its noise controls (or, unpaired, its repeats)."""
    noise: list[NoiseSummary] = field(default_factory=list)
    not_compared: list[NotCompared] = field(default_factory=list)
    note: str = ""
    """Why nothing was compared, when that is so (no control to compare against)."""
    warnings: list[str] = field(default_factory=list)
    criterion: str = ""
    """'criterion: validation/loss at step 20000 <= 1.02 x control (3.28 -> 3.3456)' when the plan's
    [criterion] judged the sets (protocol.criterion_verdict) instead of the tolerance."""
    status_text: str = ""
    """The verdict line, when the criterion wrote it."""

    @property
    def passed(self) -> bool:
        return self.status == PASS


# ---------------------------------------------------------------- entry point
def compare(family: Curve | list[Curve], tests: list[Curve], tolerance: Tolerance, *, design: str | None = None,
            expect: dict[str, str] | None = None, not_compared: list[NotCompared] | None = None,
            warnings: list[str] | None = None) -> Comparison:
    """Judge every test curve against the control family (the control first; in exact mode only
    the control is used). `expect` maps a set name to "fail" for positive controls; `not_compared`
    lists the plan's runs without a curve (they fail the comparison). Raises ValueError for
    unusable input (bad tolerance, no test set, too small a family, duplicate names)."""
    problems = tolerance.problems()
    if problems:
        raise ValueError("; ".join(problems))
    family = [family] if isinstance(family, Curve) else list(family)
    if not family:
        raise ValueError("no control curve given")
    design = design or ("exact" if tolerance.mode == "exact" else "paired")
    not_compared = list(not_compared or [])
    expect = expect or {}
    check_names(tests, allow_none=bool(not_compared))
    if tolerance.mode == "exact":
        results = [judge_exact(family[0], test, tolerance, expect.get(test.name, "pass")) for test in tests]
        noise = []
    else:
        if len(family) < 3:
            raise ValueError(f"statistical mode needs the control and at least 2 noise controls (or, unpaired, 3 "
                             f"control repeats) to measure the noise; got {len(family)} control run(s)")
        check_family_differs(family)
        results = [judge_statistical(family, test, tolerance, expect.get(test.name, "pass")) for test in tests]
        noise = noise_summaries(family, tolerance)
    return Comparison(control=family[0].name, mode=tolerance.mode, design=design, tolerance=tolerance,
                      results=results, status=plan_status(results, not_compared), controls=[c.name for c in family],
                      noise=noise, not_compared=not_compared, warnings=[*(warnings or []), *noisier_sets(results)])


NOISIER = 2.0  # a set's own standard error this many times the family's largest is worth a warning


def noisier_sets(results: list[SetResult]) -> list[str]:
    """The verdict assumes a correct set is as noisy as a noise control; say where a set that should
    pass has a curve much noisier than any of theirs (its rounding noise may be larger than they
    measure, and a FAIL of it may be that noise)."""
    found = []
    for result in results:
        for o in result.observables if result.expect == "pass" else []:
            if math.isfinite(o.within_se) and math.isfinite(o.family_within_se) and \
                    o.within_se > NOISIER * o.family_within_se:
                found.append(f"{result.name}: its {o.observable} difference is noisier than any noise control's (own "
                             f"standard error {o.within_se:.2e}, theirs at most {o.family_within_se:.2e}): the noise "
                             "controls may understate its rounding noise")
    return found


def plan_status(results: list[SetResult], not_compared: list[NotCompared]) -> str:
    """FAIL when a set that should pass fails or a run has no curve; else INCONCLUSIVE when a
    positive control passed; else PASS."""
    if not_compared or any(r.failed and r.expect == "pass" for r in results):
        return FAIL
    if any(not r.failed and r.expect == "fail" for r in results):
        return INCONCLUSIVE
    return PASS


def nothing_to_compare(control: str, tolerance: Tolerance, not_compared: list[NotCompared], note: str) -> Comparison:
    """The comparison of a plan whose control family has no curve: every set is reported, none judged."""
    design = "exact" if tolerance.mode == "exact" else "paired"
    return Comparison(control=control, mode=tolerance.mode, design=design, tolerance=tolerance, results=[],
                      status=FAIL, not_compared=not_compared, note=note)


def check_names(tests: list[Curve], allow_none: bool = False) -> None:
    if not tests and not allow_none:
        raise ValueError("no test set given")
    names = [c.name for c in tests]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"test sets must have distinct names; repeated: {', '.join(duplicates)}")


def check_family_differs(family: list[Curve]) -> None:
    """Noise controls identical to the control measure no noise: every margin would be 0."""
    first = family[0]
    if all(c.steps == first.steps and c.loss == first.loss for c in family[1:]):
        raise ValueError(f"the noise controls ({', '.join(c.name for c in family[1:])}) are bitwise identical to the "
                         f"control {first.name!r}, so they measure no noise: give them a perturbation "
                         "(debug.init_perturbation) or use exact mode for deterministic runs")


# ---------------------------------------------------------------- alignment
def common_steps(curves: list[Curve]) -> list[int]:
    steps = set(curves[0].steps)
    for curve in curves[1:]:
        steps &= set(curve.steps)
    return sorted(steps)


def values_at(curve: Curve, key: str, steps: list[int]) -> np.ndarray:
    """`key`'s values at `steps` (NaN where the curve lacks the series)."""
    series = curve.series(key)
    if series is None:
        return np.full(len(steps), math.nan)
    at = {s: i for i, s in enumerate(curve.steps)}
    return np.asarray([series[at[s]] for s in steps], dtype=np.float64)


def transformed(curve: Curve, observable: str, steps: list[int]) -> np.ndarray:
    """The values the rule compares: the loss as it is, the gradient norm as its log."""
    values = values_at(curve, observable, steps)
    if observable == "grad_norm":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(values)
    return values


def relative_diff(test: np.ndarray, control: np.ndarray) -> np.ndarray:
    """|test - control| / |control|; 0 where both are 0, inf where only the control is 0."""
    delta = np.abs(test - control)
    scale = np.abs(control)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(scale > 0, delta / np.where(scale > 0, scale, 1.0), np.where(delta == 0, 0.0, np.inf))
    return np.where(np.isnan(test) | np.isnan(control), np.nan, rel)


def _largest(steps: list[int], values: np.ndarray) -> tuple[float, int | None]:
    """Largest value and its step; NaN wins, since it means a diverged run."""
    if len(values) == 0:
        return math.nan, None
    nan = np.isnan(values)
    i = int(np.argmax(nan)) if nan.any() else int(np.argmax(values))
    return float(values[i]), int(steps[i])


def _max_or_none(values: np.ndarray) -> float | None:
    finite = values[~np.isnan(values)]
    return float(finite.max()) if len(finite) else None


# ---------------------------------------------------------------- the numbers every set reports
def summarize(test: Curve, reference: Curve, control_steps: list[int], expect: str, tol: Tolerance) -> SetResult:
    """Loss, grad-norm and learning-rate figures of a test against a reference curve on their
    common steps; the verdict fields are filled in by the caller."""
    steps = common_steps([test, reference])
    test_loss, ref_loss = values_at(test, "loss", steps), values_at(reference, "loss", steps)
    diff = test_loss - ref_loss
    n = len(steps)
    k = window_size(n, tol.final_window)
    max_abs, max_step = _largest(steps, np.abs(diff))
    grad_rel = relative_diff(values_at(test, "grad_norm", steps), values_at(reference, "grad_norm", steps))
    lr_rel = relative_diff(values_at(test, "lr", steps), values_at(reference, "lr", steps))
    have_grad = test.grad_norm is not None and reference.grad_norm is not None

    def at(values: np.ndarray, i: int) -> float:
        return float(values[i]) if n else math.nan

    return SetResult(
        name=test.name, expect=expect, steps_compared=n,
        missing_in_test=sorted(set(control_steps) - set(test.steps)),
        missing_in_control=sorted(set(test.steps) - set(control_steps)),
        initial_loss=at(test_loss, 0), final_loss=at(test_loss, -1),
        control_initial_loss=at(ref_loss, 0), control_final_loss=at(ref_loss, -1),
        max_abs_diff=max_abs, max_abs_diff_step=max_step,
        mean_abs_diff=float(np.mean(np.abs(diff))) if n else math.nan, final_diff=at(diff, -1),
        final_window_diff=float(np.mean(diff[n - k:])) if n else math.nan,
        grad_norm_max_rel_diff=_max_or_none(grad_rel) if have_grad else None,
        grad_norm_first_rel_diff=float(grad_rel[0]) if have_grad and n else None,
        lr_max_rel_diff=_max_or_none(lr_rel),
        first_diverging_step=None,
        steps=list(steps), loss_diff=[float(x) for x in diff],
        grad_norm_diff=[float(x) for x in (values_at(test, "grad_norm", steps) / values_at(reference, "grad_norm", steps)
                                            - 1)] if have_grad else [],
    )


# ---------------------------------------------------------------- exact mode
def judge_exact(control: Curve, test: Curve, tol: Tolerance, expect: str = "pass") -> SetResult:
    """Every common step within loss_atol (and grad_norm_rtol when set), every control step logged."""
    result = summarize(test, control, control.steps, expect, tol)
    diff = np.asarray(result.loss_diff)
    beyond = ~(np.abs(diff) <= tol.loss_atol)
    first = int(result.steps[int(np.argmax(beyond))]) if beyond.any() else None
    neither_has_norms = test.grad_norm is None and control.grad_norm is None
    result.failed, result.reason = exact_reason(result, first, diff, tol, neither_has_norms)
    result.first_diverging_step = first if result.failed else None
    return result


def exact_reason(r: SetResult, first: int | None, diff: np.ndarray, tol: Tolerance,
                 neither_has_norms: bool = False) -> tuple[bool, str]:
    """(failed, why). Curves without any gradient norm (another trainer's) are judged on the loss
    alone, and say so; a norm logged by one side only fails."""
    if r.steps_compared == 0:
        return True, "no step in common with the control"
    if first is not None:
        d = float(diff[r.steps.index(first)])
        return True, f"step {first}: loss diff {d:+.3e} exceeds loss_atol {tol.loss_atol:.3e}"
    if tol.grad_norm_rtol > 0 and not neither_has_norms:
        if not r.grad_norm_diff:
            return True, "grad_norm_rtol is set but only one of the test and the control logged a grad norm"
        rel = np.abs(np.asarray(r.grad_norm_diff))
        beyond = ~(rel <= tol.grad_norm_rtol)
        if beyond.any():
            i = int(np.argmax(beyond))
            return True, (f"step {r.steps[i]}: grad-norm relative diff {rel[i]:.3e} exceeds grad_norm_rtol "
                          f"{tol.grad_norm_rtol:.3e}")
    if r.missing_in_test:
        return True, f"the test did not log {len(r.missing_in_test)} control step(s), first {r.missing_in_test[0]}"
    grad = f", grad norm within {tol.grad_norm_rtol:.0e}" if tol.grad_norm_rtol > 0 and r.grad_norm_diff else ""
    grad += "; no grad norm logged, so it was not judged" if neither_has_norms and tol.grad_norm_rtol > 0 else ""
    return False, f"max |loss diff| {r.max_abs_diff:.3e} <= loss_atol {tol.loss_atol:.3e} over {r.steps_compared} steps{grad}"


# ---------------------------------------------------------------- statistical mode
def family_mean(family: list[Curve]) -> Curve:
    """The per-step mean of the family on the steps all of them logged (loss and grad norm)."""
    steps = common_steps(family)
    if not steps:
        raise ValueError("the control runs share no logged step: " + ", ".join(c.name for c in family))
    loss = np.mean([values_at(c, "loss", steps) for c in family], axis=0)
    grad = None
    if all(c.grad_norm is not None for c in family):
        grad = np.exp(np.mean([np.log(values_at(c, "grad_norm", steps)) for c in family], axis=0)).tolist()
    extra = {key: np.mean([values_at(c, key, steps) for c in family], axis=0).tolist()
             for key in ("lr",) if all(c.series(key) is not None for c in family)}
    return Curve(name=f"mean({', '.join(c.name for c in family)})", steps=steps, loss=loss.tolist(), grad_norm=grad,
                 source="; ".join(c.source for c in family), extra=extra)


def judge_statistical(family: list[Curve], test: Curve, tol: Tolerance, expect: str = "pass") -> SetResult:
    """Each judged observable by protocol.decision.judge, on the steps every run logged."""
    reference = family_mean(family)
    result = summarize(test, reference, family[0].steps, expect, tol)
    if result.steps_compared == 0:
        result.reason = "no step in common with the control"
        return result
    if result.steps[-1] < reference.steps[-1]:  # judged on an earlier, easier window otherwise
        result.reason = f"the test stops at step {result.steps[-1]}, before the control's last step {reference.steps[-1]}"
        return result
    steps = common_steps([*family, test])
    reasons = []
    for observable in tol.observables:
        verdict, problem = judge_observable(family, test, observable, steps, tol)
        if problem:
            reasons.append(f"{observable}: {problem}")
            continue
        result.observables.append(verdict)
        if not verdict.passed:
            reasons.append(f"{observable}: {verdict.reason}")
    result.failed = bool(reasons)
    located = [v.first_outside_noise for v in result.observables if not v.passed and v.first_outside_noise]
    result.first_diverging_step = min(located) if located else None
    result.reason = "; ".join(reasons) if reasons else "; ".join(f"{v.observable}: {v.reason}" for v in result.observables)
    return result


def judge_observable(family: list[Curve], test: Curve, observable: str, steps: list[int],
                     tol: Tolerance) -> tuple[ObservableVerdict | None, str | None]:
    """(verdict, None), or (None, why it cannot be judged): not logged, or not finite in the test
    where the family is (a diverged run)."""
    if any(c.series(observable) is None for c in (*family, test)):
        missing = [c.name for c in (*family, test) if c.series(observable) is None]
        return None, f"not logged by {', '.join(missing)}"
    rows = np.array([transformed(c, observable, steps) for c in family])
    values = transformed(test, observable, steps)
    family_finite = np.isfinite(rows).all(axis=0)
    broken = family_finite & ~np.isfinite(values)
    if broken.any():
        return None, f"not finite at step {steps[int(np.argmax(broken))]} (the family's is)"
    keep = family_finite  # float16 steps skipped for an overflow log no norm
    if keep.sum() < 3:
        return None, "fewer than 3 steps where every run logged a finite value"
    return judge(np.asarray(steps)[keep], rows[:, keep], values[keep], observable, tol), None


def noise_summaries(family: list[Curve], tol: Tolerance) -> list[NoiseSummary]:
    """Noise SD, margin, detectable effect and growth of each judged observable, from the family."""
    steps = common_steps(family)
    n = len(steps)
    k = window_size(n, tol.final_window)
    members = len(family)
    summaries = []
    for observable in tol.observables:
        if any(c.series(observable) is None for c in family):
            continue
        rows = np.array([transformed(c, observable, steps) for c in family])
        keep = np.isfinite(rows).all(axis=0)
        rows = rows[:, keep]
        kept_steps = [s for s, ok in zip(steps, keep) if ok]
        if rows.shape[1] < 3:
            continue
        means = rows[:, -k:].mean(axis=1)
        sigma = noise_sd(rows[:, -k:])
        margin, _ = margin_for(observable, sigma, tol)
        summaries.append(NoiseSummary(
            observable=observable, noise_sd=sigma, margin=margin,
            mde=minimum_detectable_effect(margin, sigma, members - 1, tol),
            mde_if_noisier=detectable_if_noisier(margin, sigma, members - 1, tol),
            false_fail=false_fail_chance(margin, sigma, members - 1, tol),
            member_diffs={c.name: float(m - means.mean()) for c, m in zip(family, means)},
            growth=noise_growth(kept_steps, rows)))
    return summaries


def noise_growth(steps: list[int], rows: np.ndarray, half_width: int = 5) -> list[tuple[int, float]]:
    """RMS over the noise controls (rows 1..) of their difference from the control (row 0), over
    the steps within half_width of each growth point."""
    n = len(steps)
    paired = rows[1:] - rows[0]
    points = sorted({min(n - 1, max(0, math.ceil(f * n) - 1)) for f in GROWTH_POINTS})
    growth = []
    for i in points:
        window = paired[:, max(0, i - half_width):i + half_width + 1]
        growth.append((int(steps[i]), float(np.sqrt(np.mean(window ** 2)))))
    return growth
