"""Judging a run by the plan's [criterion]: its measure, the bound, and whether it meets it.

The same judgement serves `protocol run` (a search decides which point to run next) and
`protocol compare` (the verdict and the sweep report), and it is read from the run folders
alone, so both see the same numbers. A relative criterion's bound is the control's value of the
same measure times the factor: without the control's value no set can be judged.

The noise of the measure (`family_noise`) is read from the control family's run folders (the
control and its noise controls: the launches with role "control" and "noise"): sigma, the noise
SD of the measure for one more run, is the sample SD of the members' values x sqrt(1 + 1/(K + 1))
with K + 1 members (protocol.plan.criteria). It is the unit of a `max_sigmas_above_control` bound and
of every criterion's margin in the report (protocol.verdict.by_criterion).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from protocol.plan.criteria import Criterion
from protocol.plan.early_stop import Breach, applies, stopped
from protocol.plan.measure import Value, measure, read_records
from protocol.plan.model import Launch, Plan

# Fewest family members with a value for sigma: the least compare() accepts for a statistical
# family (2 degrees of freedom); fewer give an SD too unreliable to be a unit.
MIN_MEMBERS = 3


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


@dataclass(frozen=True)
class Noise:
    """The noise of the criterion's measure in the control family: sigma (None, with why, when it
    cannot be measured) and each member's value."""

    sigma: float | None
    values: dict[str, float]
    missing: str = ""

    def describe(self) -> str:
        """'0.0021 nats from the control family's 5 runs' (those that have a value)."""
        return f"{self.sigma:.3g} nats from the control family's {len(self.values)} runs"


def family_noise(plan: Plan) -> Noise:
    """sigma of the criterion's measure from the control family's run folders (module docstring)."""
    family = [launch for launch in plan.launches() if launch.role in ("control", "noise")]
    if len(family) == 1:
        return Noise(None, {}, "no noise measured: the plan has no noise controls (exact mode); run them with "
                               "[tolerance] mode = \"statistical\"")
    values, why = {}, []
    for launch in family:
        value = measure(read_records(launch.output), plan.criterion.measure)
        if value.value is not None and math.isfinite(value.value):
            values[launch.name] = value.value
        else:
            why.append(f"{launch.name}: {value.missing or value.value}")
    if len(values) < MIN_MEMBERS:
        return Noise(None, values, f"sigma needs at least {MIN_MEMBERS} of the control family's runs with a value of "
                                   f"{plan.criterion.measure.describe()}, {len(values)} have one ({'; '.join(why)})")
    spread = statistics.stdev(values.values())
    if spread == 0:  # bitwise-equal runs: nothing perturbed them, so they measured no noise
        return Noise(None, values, f"the control family's {len(values)} runs have the same value of "
                                   f"{plan.criterion.measure.describe()}: they measure no noise")
    # A new run's offset from the family: the members' spread, plus the family's own uncertainty.
    return Noise(spread * math.sqrt(1 + 1 / len(values)), values)


def threshold(plan: Plan, control: Value, noise: Noise | None = None) -> Value:
    """The bound every set is judged by; None (with why) for a relative criterion whose control
    has no value, or a bound in noise SDs without sigma. `noise`: family_noise(plan), read here
    when the bound needs it and it is not given."""
    if not plan.criterion.relative:
        return Value(plan.criterion.max)
    if control.value is None or not math.isfinite(control.value):
        return Value(None, control.missing or f"the control's value is {control.value}")
    if not plan.criterion.in_sigmas:
        return Value(plan.criterion.threshold(control.value))
    noise = noise or family_noise(plan)
    if noise.sigma is None:
        return Value(None, noise.missing)
    return Value(plan.criterion.threshold(control.value, noise.sigma))


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


def judge_plan(plan: Plan, noise: Noise | None = None) -> tuple[Value, dict[str, Judgement]]:
    """The control's value and every test set's judgement, by name (`noise`: as for threshold())."""
    control = control_value(plan)
    bound = threshold(plan, control, noise)
    tests = [launch for launch in plan.launches() if launch.role == "test"]
    return control, {launch.name: judge_run(plan, launch, bound) for launch in tests}
