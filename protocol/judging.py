"""Judging a run by the plan's [criterion]: its measure, the bound, and whether it meets it.

The same judgement serves `protocol run` (a search decides which point to run next) and
`protocol compare` (the verdict and the sweep report), and it is read from the run folders
alone, so both see the same numbers. A relative criterion's bound is the control's value of the
same measure times the factor: without the control's value no set can be judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.criteria import Criterion
from protocol.early_stop import Breach, applies, stopped
from protocol.measure import Value, measure, read_records
from protocol.plan import Launch, Plan


@dataclass(frozen=True)
class Judgement:
    """One run against the criterion. meets: None when it cannot be judged (no value: not run,
    failed, or the control's value is missing); a stopped run does not meet it."""

    name: str
    value: float | None
    threshold: float | None
    meets: bool | None
    stopped: Breach | None = None
    missing: str = ""

    def describe(self, criterion: Criterion) -> str:
        """'validation/loss at step 20 = 3.31 <= 3.3456: meets the criterion', or why not judged."""
        if self.stopped is not None:
            return f"STOPPED by {self.stopped.describe()}"
        if self.meets is None:
            return f"not judged: {self.missing}"
        relation = "<=" if self.meets else ">"
        verdict = "meets the criterion" if self.meets else "misses the criterion"
        return f"{criterion.measure.describe()} = {self.value:.5g} {relation} {self.threshold:.5g}: {verdict}"


def control_launch(plan: Plan) -> Launch:
    return next(launch for launch in plan.launches() if launch.role == "control")


def control_value(plan: Plan) -> Value:
    """The control's value of the criterion's measure (what a relative bound multiplies)."""
    value = measure(read_records(control_launch(plan).output), plan.criterion.measure)
    if value.value is None:
        return Value(None, f"the control {plan.control.name!r} has none: {value.missing}")
    return value


def threshold(plan: Plan, control: Value) -> Value:
    """The bound every set is judged by; None (with why) for a relative criterion whose control
    has no value."""
    if not plan.criterion.relative:
        return Value(plan.criterion.max)
    if control.value is None or not math.isfinite(control.value):
        return Value(None, control.missing or f"the control's value is {control.value}")
    return Value(plan.criterion.threshold(control.value))


def judge_run(plan: Plan, launch: Launch, bound: Value) -> Judgement:
    """The run in the launch's folder against `bound` (threshold())."""
    breach = stopped(launch.output, plan.early_stop) if applies(launch) else None
    if breach is not None:
        return Judgement(launch.name, None, bound.value, False, stopped=breach)
    value = measure(read_records(launch.output), plan.criterion.measure)
    if value.value is None:
        return Judgement(launch.name, None, bound.value, None, missing=value.missing)
    if bound.value is None:
        return Judgement(launch.name, value.value, None, None, missing=bound.missing)
    return Judgement(launch.name, value.value, bound.value, bool(value.value <= bound.value))


def judge_plan(plan: Plan) -> tuple[Value, dict[str, Judgement]]:
    """The control's value and every test set's judgement, by name."""
    control = control_value(plan)
    bound = threshold(plan, control)
    tests = [launch for launch in plan.launches() if launch.role == "test"]
    return control, {launch.name: judge_run(plan, launch, bound) for launch in tests}
