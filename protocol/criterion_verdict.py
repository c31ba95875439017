"""The verdict of a plan with a [criterion]: every set is judged by it instead of the tolerance.

The comparison with the control is still computed and reported (the per-step differences say
how far a set is from the control), but a set passes when it meets the criterion and fails when
it misses it or is not judged (no value of the measure). The points of a sweep are measurements:
a point that misses the criterion, or that an early-stop rule stopped, is what the sweep found,
not a failure of the plan; the plan fails when a [[sets]] set misses it, a run failed, a run the
plan needs did not run, or a sweep has no point that meets it. A positive control
(`expect = "fail"`) that meets the criterion makes the plan INCONCLUSIVE. Points of a searched
sweep that the search did not need are neither run nor counted (protocol.search).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protocol.compare import FAIL, INCONCLUSIVE, PASS, Comparison
from protocol.judging import judge_plan, threshold
from protocol.plan import Plan
from protocol.search import replay
from protocol.sweep_report import SweepReport, sweep_table


@dataclass
class CriterionVerdict:
    comparison: Comparison
    """Every set judged by the criterion."""
    sweeps: SweepReport
    bound: float | None
    """The value a set's measure must not exceed (None: the control has none)."""
    unneeded: set[str]
    """Search points that did not run because the search did not need them (yet): not runs of the report."""


def judge_by_criterion(plan: Plan, comparison: Comparison) -> CriterionVerdict:
    """The comparison with every set judged by the criterion, and the sweep report."""
    control, judgements = judge_plan(plan)
    bound = threshold(plan, control)
    line = f"criterion: {plan.criterion.describe(control.value)}"
    searches = {sweep.name: replay(sweep, judgements) for sweep in plan.sweeps if sweep.search}
    skipped = {m.name for m in comparison.not_compared if unneeded(m.name, m.verdict, searches.values())}
    not_compared = [m for m in comparison.not_compared if m.name not in skipped]
    points = {name for sweep in plan.sweeps for name in sweep.points}
    expect = {spec.name: spec.expect for spec in plan.sets}
    for result in comparison.results:
        judged = judgements[result.name]
        result.failed = judged.meets is not True
        result.reason = judged.describe(plan.criterion)
        result.first_diverging_step = None  # the tolerance's, which did not decide
        if result.name in points and expect.get(result.name) == "pass":
            result.label = "meets criterion" if judged.meets else "misses criterion"
    verdicts = {m.name: m.verdict for m in not_compared}
    tables = [sweep_table(plan, sweep, control, judgements, verdicts, searches.get(sweep.name))
              for sweep in plan.sweeps]
    report = SweepReport(line, plan.criterion.measure.describe(), tables)
    status, text = plan_verdict(comparison, not_compared, points, expect, report, line)
    warnings = [*comparison.warnings, *(w for table in tables for w in table.warnings)]
    judged = dataclasses.replace(comparison, not_compared=not_compared, status=status, criterion=line,
                                 status_text=text, warnings=warnings)
    return CriterionVerdict(judged, report, bound.value, skipped)


def unneeded(name: str, verdict: str, searches) -> bool:
    """A search point the search did not visit and that never ran is not missing: it was not needed
    (or, in an unfinished search, not needed yet)."""
    return verdict == "NOT RUN" and any(name in s.sweep.points and name not in s.visited for s in searches)


def plan_verdict(comparison: Comparison, not_compared, points: set[str], expect: dict[str, str],
                 report: SweepReport, line: str) -> tuple[str, str]:
    """(status, verdict line) by the rules of the module docstring."""
    measured = {name for name in points if expect.get(name) == "pass"}
    bad = [r.name for r in comparison.results if r.failed and r.expect == "pass" and r.name not in measured]
    bad += [m.name for m in not_compared if not (m.verdict == "STOPPED" and m.name in measured)]
    empty = [f"sweep {t.sweep.name!r}: {t.answer}" for t in report.tables if t.answer.startswith("no set")]
    answers = [f"sweep {t.sweep.name!r}: {t.answer}" for t in report.tables]
    if bad or empty:
        return FAIL, f"FAIL: {', '.join(bad + empty)} ({line})"
    caught = [r.name for r in comparison.results if r.expect == "fail" and not r.failed]
    if caught:
        return INCONCLUSIVE, (f"INCONCLUSIVE: positive control {', '.join(caught)} meets the {line}, so the criterion "
                              "cannot tell a bug of that size")
    sets = [r for r in comparison.results if r.name not in points]
    said = ["every test set meets it"] if sets or not answers else []
    return PASS, f"PASS: {line}; " + "; ".join(said + answers)

