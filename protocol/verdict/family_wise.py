"""The plan's false-fail rate, not a set's: Holm's step-down over every judged (set, observable).

Each observable of a set is judged at the tolerance's levels (protocol.verdict.decision); a plan fails
when any one fails, so a plan of several correct sets would fail by chance more often than one
set does (by the design table of docs/protocol_measurements.md, 1.9% per set becomes 6.1% for 4 sets).
Here the rule's failures are re-read as rejections of "this set trains like the control" and
the family-wise error over the whole plan is held at `tolerance.plan_false_fail`:

* each observable has one p-value for failing: its offset test's (Student-t with K degrees of
  freedom of D / sigma, two-sided: the chance a correct set's offset is at least this large)
  and its drift test's (only where the drift moves the difference by more than the margin, as
  the rule asks), combined by weighted Bonferroni (OFFSET_WEIGHT to the offset), so that a
  correct set fails either way with at most the p-value's probability;
* Holm's step-down over the plan's m p-values, smallest first: the i-th smallest is rejected
  when it and every smaller one are below plan_false_fail / (m - i + 1). This holds the chance
  that any correct set of the plan fails at plan_false_fail whatever the dependence between
  them (they share the control family), and positive controls, rejected first, leave the
  correct sets the more lenient thresholds;
* an observable fails only when Holm rejects it and the tolerance's own rule fails it too (not
  equivalent within the margin, or drifting): the margin stays a floor.

The p-values use the family's spread alone (K degrees of freedom); sigma is the larger of that
and the pooled within-run estimate, so they are upper bounds and the stated rate a bound too.
"""

from __future__ import annotations

import math

from protocol.plan.tolerance import Tolerance
from protocol.verdict.decision import ObservableVerdict, explain
from protocol.verdict.statistics import t_quantile, t_upper_tail

OFFSET_WEIGHT = 0.8
"""Share of an observable's level given to its offset test; the rest goes to its drift test."""


def failure_p_value(v: ObservableVerdict) -> float:
    """The chance a correct set fails this observable at least as clearly: weighted Bonferroni of
    the offset and the drift tests (a drift within the margin cannot fail, so it counts as 1)."""
    p_offset = offset_p_value(v)
    p_drift = v.drift_p if v.drift > v.margin else 1.0
    return min(1.0, p_offset / OFFSET_WEIGHT, p_drift / (1 - OFFSET_WEIGHT))


def offset_p_value(v: ObservableVerdict) -> float:
    """P(|T_K| >= |D| / sigma): a correct set's offset is at least this large."""
    if v.noise_sd == 0:
        return 0.0 if v.diff != 0 else 1.0
    return min(1.0, 2 * t_upper_tail(abs(v.diff) / v.noise_sd, v.dof))


def holm(p_values: list[float], level: float) -> list[tuple[float, bool]]:
    """(threshold, rejected) per p-value, in their order: Holm's step-down at `level`."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out: list[tuple[float, bool]] = [(level, False)] * m
    rejecting = True
    for rank, i in enumerate(order):
        threshold = level / (m - rank)
        rejecting = rejecting and p_values[i] <= threshold
        out[i] = (threshold, rejecting)
    return out


def offset_bound_sigmas(threshold: float, dof: int) -> float:
    """|D| / sigma from which the offset test alone is rejected at `threshold`."""
    return t_quantile(1 - OFFSET_WEIGHT * threshold / 2, dof)


def apply_plan_level(verdicts: list[ObservableVerdict], tol: Tolerance) -> None:
    """Set every verdict's p-value, Holm threshold, applied bound and final outcome, in place."""
    p_values = [failure_p_value(v) for v in verdicts]
    for v, p, (threshold, rejected) in zip(verdicts, p_values, holm(p_values, tol.plan_false_fail)):
        t_crit = t_quantile(1 - tol.alpha, v.dof)
        margin_floor = (v.margin - t_crit * v.noise_sd) / v.noise_sd if v.noise_sd > 0 else 0.0
        v.p_value, v.holm_threshold = p, threshold
        v.bound = max(margin_floor, offset_bound_sigmas(threshold, v.dof)) * v.noise_sd
        v.chance_fail = min(1.0, 2 * t_upper_tail(v.bound / v.noise_sd, v.dof)) if v.noise_sd > 0 else 0.0
        v.passed = not (rejected and (not v.equivalent or v.drifting))
        v.reason = explain(v, t_crit)


def set_false_fail(verdicts: list[ObservableVerdict]) -> float:
    """At most the chance that a correct set fails one of these observables by chance (their
    applied bounds, Bonferroni)."""
    return min(1.0, sum(v.chance_fail for v in verdicts if math.isfinite(v.chance_fail)))
