"""Statistical mode: every judged observable of a set paired step by step with the control family
(the control and its noise controls, on identical data) and judged by protocol.verdict.decision; the
family's own noise figures for the report; float16 steps skipped for an overflow left out."""

from __future__ import annotations

import math

import numpy as np

from protocol.plan.tolerance import Tolerance
from protocol.verdict.alignment import common_steps, skipped_steps, summarize, transformed, values_at
from protocol.verdict.curves import Curve
from protocol.verdict.decision import (ObservableVerdict, detectable_if_noisier, false_fail_chance, judge, margin_for,
                                       family_noise_sd, minimum_detectable_effect)
from protocol.verdict.family_wise import offset_bound_sigmas
from protocol.verdict.results import NoiseSummary, SetResult
from protocol.verdict.statistics import t_quantile, window_size

# Points of the run (fractions of its steps) at which the noise controls' paired difference is
# reported, to show how rounding noise grows with steps.
GROWTH_POINTS = (0.01, 0.1, 0.25, 0.5, 1.0)


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
    """Each judged observable by protocol.verdict.decision.judge, on the steps every run logged and none
    skipped; the verdict is settled once the plan-level bounds are known (settle())."""
    reference = family_mean(family)
    result = summarize(test, reference, family[0].steps, expect, tol)
    result.skipped_steps = len(skipped_steps(test))
    if result.steps_compared == 0:
        result.problems.append("no step in common with the control")
    elif result.steps[-1] < reference.steps[-1]:  # judged on an earlier, easier window otherwise
        result.problems.append(f"the test stops at step {result.steps[-1]}, before the control's last step "
                               f"{reference.steps[-1]}")
    if result.problems:
        settle(result)
        return result
    # A step that any compared run skipped for an overflow is missing for every run and both
    # observables: its update never happened in that run, and once one run skips, its scale-growth
    # clock is out of phase with the others, so correct runs skip different steps.
    skipped = set().union(*(skipped_steps(c) for c in (*family, test)))
    steps = [s for s in common_steps([*family, test]) if s not in skipped]
    problem = skip_count_problem(family, test)
    if problem:
        result.problems.append(f"float16 skips: {problem}")
    for observable in tol.observables:
        verdict, problem = judge_observable(family, test, observable, steps, tol)
        if problem:
            result.problems.append(f"{observable}: {problem}")
        else:
            result.observables.append(verdict)
    settle(result)
    return result


def settle(result: SetResult) -> None:
    """failed, reason and first diverging step from the observables' verdicts and the problems."""
    reasons = [*result.problems, *(f"{v.observable}: {v.reason}" for v in result.observables if not v.passed)]
    result.failed = bool(reasons)
    located = [v.first_outside_noise for v in result.observables if not v.passed and v.first_outside_noise]
    result.first_diverging_step = min(located) if located else None
    result.reason = "; ".join(reasons) if reasons else "; ".join(f"{v.observable}: {v.reason}" for v in result.observables)


SKIPS_ALLOWED = (2, 2)
"""(factor, extra): a set may skip up to factor x the family's most skips + extra steps; beyond
that it overflows far more often than out-of-phase loss scaling explains."""


def skip_count_problem(family: list[Curve], test: Curve) -> str | None:
    counts = [len(skipped_steps(c)) for c in family]
    own = len(skipped_steps(test))
    factor, extra = SKIPS_ALLOWED
    if own <= factor * max(counts) + extra:
        return None
    return (f"skipped {own} steps for an overflow where the control family skipped {min(counts)}-{max(counts)} "
            f"(more than {factor} x their most + {extra}): it overflows far more often than rounding explains")


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
    keep = family_finite
    if keep.sum() < 3:
        return None, "fewer than 3 steps where every run logged a finite value"
    return judge(np.asarray(steps)[keep], rows[:, keep], values[keep], observable, tol), None


def noise_summaries(family: list[Curve], tol: Tolerance, judged: int = 1) -> list[NoiseSummary]:
    """Noise SD, margin, detectable effect and growth of each judged observable, from the family
    alone: the report's summary of the noise. A set's verdict uses its own unit, this noise with
    the set's own added (decision.with_own_noise). `judged`: the (set, observable) pairs of the
    plan, whose count sets the plan-level bound."""
    steps = common_steps(family)
    n = len(steps)
    k = window_size(n, tol.final_window)
    members = len(family)
    summaries = []
    for observable in tol.observables:
        if any(c.series(observable) is None for c in family):
            continue
        rows = np.array([transformed(c, observable, steps) for c in family])
        skipped = set().union(*(skipped_steps(c) for c in family))
        keep = np.isfinite(rows).all(axis=0) & np.array([s not in skipped for s in steps])
        rows = rows[:, keep]
        kept_steps = [s for s, ok in zip(steps, keep) if ok]
        if rows.shape[1] < 3:
            continue
        means = rows[:, -k:].mean(axis=1)
        sigma = family_noise_sd(rows[:, -k:])
        margin, _ = margin_for(observable, sigma, tol)
        summaries.append(NoiseSummary(
            observable=observable, noise_sd=sigma, margin=margin,
            mde=minimum_detectable_effect(margin, sigma, members - 1, tol),
            mde_if_noisier=detectable_if_noisier(margin, sigma, members - 1, tol),
            false_fail=false_fail_chance(margin, sigma, members - 1, tol),
            plan_mde=plan_level_detectable(margin, sigma, members - 1, tol, judged),
            member_diffs={c.name: float(m - means.mean()) for c, m in zip(family, means)},
            growth=noise_growth(kept_steps, rows)))
    return summaries


def plan_level_detectable(margin: float, sigma: float, dof: int, tol: Tolerance, judged: int) -> float:
    """The offset failed with probability tol.power under the plan-level bound at its strictest
    (Holm's first threshold, plan_false_fail / judged): what every set of the plan can detect."""
    floor = margin - t_quantile(1 - tol.alpha, dof) * sigma
    bound = max(floor, offset_bound_sigmas(tol.plan_false_fail / max(judged, 1), dof) * sigma)
    return bound + t_quantile(tol.power, dof) * sigma


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
