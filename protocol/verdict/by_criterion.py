"""The verdict of a plan with a [criterion]: every set is judged by it instead of the tolerance.

The comparison with the control is still computed and reported (the per-step differences say
how far a set is from the control), but a set passes when it meets the criterion and fails when
it misses it or is not judged (no value of the measure). The points of a sweep are measurements:
a point that misses the criterion, or that an early-stop rule stopped, is what the sweep found,
not a failure of the plan; the plan fails when a [[sets]] set misses it, a run failed, a run the
plan needs did not run, or a sweep has no point that meets it. A positive control
(`expect = "fail"`) that meets the criterion makes the plan INCONCLUSIVE. Points of a searched
sweep that the search did not need are neither run nor counted (protocol.plan.search).

The criterion's line in the report states its margin, the bound minus the control's value, in
nats, in noise SDs of the measure (sigma of the control family, protocol.plan.judging.family_noise;
in exact mode, which runs no noise controls, it says so and how to get them), and in detectable
offsets of the loss (the `mde` of the statistical comparison). A margin of more than LOOSE
detectable offsets is worth a warning: such a criterion approves sets that the plan's own noise
controls would show to be far from the control.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from protocol.plan.judging import Noise, family_noise, judge_plan, threshold
from protocol.plan.measure import Value
from protocol.plan.model import Plan
from protocol.plan.search import replay
from protocol.verdict.results import FAIL, INCONCLUSIVE, PASS, Comparison
from protocol.verdict.sweep_table import SweepReport, sweep_table


@dataclass
class CriterionVerdict:
    comparison: Comparison
    """Every set judged by the criterion."""
    sweeps: SweepReport
    bound: float | None
    """The value a set's measure must not exceed (None: the control has none)."""
    unneeded: set[str]
    """Search points that did not run because the search did not need them (yet): not runs of the report."""


# A criterion whose margin is this many times the plan's detectable loss offset is looser than the
# plan can measure, by an order of magnitude: it would pass sets the statistical rule fails.
LOOSE = 10.0


def judge_by_criterion(plan: Plan, comparison: Comparison) -> CriterionVerdict:
    """The comparison with every set judged by the criterion, and the sweep report."""
    noise = family_noise(plan)
    control, judgements = judge_plan(plan, noise)
    bound = threshold(plan, control, noise)
    line, stated, loose = state(plan, comparison, control, bound, noise)
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
    report = SweepReport(stated, plan.criterion.measure.describe(), tables)
    status, text = plan_verdict(comparison, not_compared, points, expect, report, line)
    warnings = [*comparison.warnings, *loose, *(w for table in tables for w in table.warnings)]
    judged = dataclasses.replace(comparison, not_compared=not_compared, status=status, criterion=stated,
                                 status_text=text, warnings=warnings)
    return CriterionVerdict(judged, report, bound.value, skipped)


def state(plan: Plan, comparison: Comparison, control: Value, bound: Value,
          noise: Noise) -> tuple[str, str, list[str]]:
    """(the criterion's line for the verdict, the same with its margin for the report, the warning
    of a loose criterion): the verdict line keeps the short form, the report says how tight it is."""
    described = plan.criterion.describe(control.value, noise.sigma)
    nats = margin_nats(control, bound)
    mde = detectable_loss_offset(comparison)
    line = f"criterion: {described}"
    return line, line + margin_text(nats, noise, mde, bound), loose_warnings(described, nats, mde)


def margin_nats(control: Value, bound: Value) -> float | None:
    """How far above the control's value a set may be: the bound minus the control's value (None
    when either is unknown)."""
    if control.value is None or bound.value is None or not math.isfinite(control.value):
        return None
    return bound.value - control.value


def detectable_loss_offset(comparison: Comparison) -> float | None:
    """The statistical comparison's minimum detectable offset of the loss (None in exact mode, or
    when the loss was not judged)."""
    found = [n.mde for n in comparison.noise if n.observable == "loss"] if comparison.mode == "statistical" else []
    return found[0] if found and math.isfinite(found[0]) and found[0] > 0 else None


def margin_text(nats: float | None, noise: Noise, mde: float | None, bound: Value) -> str:
    """' [margin +0.088 nats above the control: 210 noise SDs of the measure (sigma 0.00042 nats
    from the control family's 5 runs), 55 x the detectable loss offset (0.0016 nats)]': the
    allowance in the units that say whether it is tight, or why a unit is missing."""
    if nats is None:
        return f" [margin above the control not known: {bound.missing or 'the control has no value'}]"
    text = f" [margin {nats:+.3g} nats above the control"
    if noise.sigma is not None:
        text += f": {nats / noise.sigma:.3g} noise SDs of the measure (sigma {noise.describe()})"
    else:
        text += f"; {noise.missing}"
    if mde is not None:
        text += f", {nats / mde:.3g} x the detectable loss offset ({mde:.3g} nats)"
    return text + "]"


def loose_warnings(criterion: str, nats: float | None, mde: float | None) -> list[str]:
    """Warn when the criterion allows more than LOOSE detectable loss offsets above the control."""
    if nats is None or mde is None or nats <= LOOSE * mde:
        return []
    return [f"the criterion {criterion} allows {nats:.3g} nats above the control, {nats / mde:.3g} times the plan's "
            f"detectable loss offset ({mde:.3g} nats): it approves sets the noise controls show to be far from the "
            "control; a bound in noise units (max_sigmas_above_control) is as tight as the plan can measure"]


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
        who = f"positive control {caught[0]} meets" if len(caught) == 1 else \
            f"positive controls {', '.join(caught)} meet"
        return INCONCLUSIVE, f"INCONCLUSIVE: {who} the {line}, so the criterion cannot tell a bug of that size"
    sets = [r for r in comparison.results if r.name not in points]
    said = ["every test set meets it"] if sets or not answers else []
    return PASS, f"PASS: {line}; " + "; ".join(said + answers)

