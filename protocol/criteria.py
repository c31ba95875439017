"""What a set must reach, and when a run is not worth finishing: the `[criterion]` and
`[[early_stop]]` tables.

    [criterion]                     # judges every set: pass = meets it
    metric = "validation/loss"      # or "loss": the training loss averaged over `window` steps
    step = 20000                    # default: plan.steps
    max_vs_control = 1.02           # metric <= the control's value x 1.02 (or max = 3.35: metric <= 3.35)

    [[early_stop]]                  # checked while a set runs; a breaking run is stopped
    step = 5000
    metric = "validation/loss"
    above = 3.8

Both read a `Measure` from a run's metrics.jsonl (protocol.measure). Reading is in two passes, as
for every table of a plan: the table's own keys first (types, choices, one bound), then, once
the plan's steps and the runs' validation and logging frequencies are known, whether the step
can be measured at all (protocol.plan_file). Every problem names its key and what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.schema import CRITERION_KEYS, EARLY_STOP_KEYS, METRICS, check_choice, check_minimum, read_table

VALIDATION, TRAIN_LOSS = METRICS


@dataclass(frozen=True)
class Measure:
    """A number of one run: the validation loss at `step`, or the mean training loss over the
    `window` steps ending at `step` (the steps the trainer logged among them)."""

    metric: str
    step: int
    window: int | None = None

    def describe(self) -> str:
        """'validation/loss at step 20000' or 'train loss mean over steps 19901-20000'."""
        if self.metric == TRAIN_LOSS:
            return f"train loss mean over steps {self.step - (self.window or 1) + 1}-{self.step}"
        return f"{self.metric} at step {self.step}"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "step": self.step, "window": self.window}


@dataclass(frozen=True)
class Criterion:
    """metric <= max (absolute), or metric <= the control's value of it x max_vs_control."""

    measure: Measure
    max: float | None = None
    max_vs_control: float | None = None

    @property
    def relative(self) -> bool:
        return self.max_vs_control is not None

    def threshold(self, control_value: float | None) -> float | None:
        """The bound a set's value must not exceed; None for a relative criterion without the
        control's value."""
        if not self.relative:
            return self.max
        return None if control_value is None else control_value * self.max_vs_control

    def describe(self, control_value: float | None = None) -> str:
        """'validation/loss at step 20000 <= 1.02 x control (3.28 -> 3.3456)'; the bracket only
        once the control's value is known."""
        if not self.relative:
            return f"{self.measure.describe()} <= {self.max:g}"
        text = f"{self.measure.describe()} <= {self.max_vs_control:g} x control"
        if control_value is not None:
            text += f" ({control_value:.5g} -> {self.threshold(control_value):.5g})"
        return text


@dataclass(frozen=True)
class StopRule:
    """Stop a set's run when its measure is above `above` (or not a number: a diverged run)."""

    measure: Measure
    above: float
    where: str  # "early_stop[0]", for messages

    def describe(self) -> str:
        return f"{self.where}: stop when {self.measure.describe()} > {self.above:g}"

    def to_dict(self) -> dict[str, Any]:
        return {**self.measure.to_dict(), "above": self.above}


@dataclass(frozen=True)
class Frequencies:
    """What decides whether a step can be measured in the runs: the plan's steps, the validation
    frequency (None: validation is off), and how often the training loss is logged."""

    steps: int
    validation_freq: int | None
    log_freq: int


# ---------------------------------------------------------------------------------------------
# Reading the tables (first pass: the table's own keys)


def read_criterion(data: Any, problems: list[str]) -> dict[str, Any] | None:
    """The [criterion] table's valid values (None without the table); a missing or doubled bound
    and a misplaced window are problems."""
    if data is None:
        return None
    values = read_measure_keys(data, CRITERION_KEYS, "criterion", problems)
    for key in ("max", "max_vs_control"):
        if key in values:
            values[key] = float(values[key])
    bounds = [key for key in ("max", "max_vs_control") if key in values]
    if len(bounds) == 2:
        problems.append("criterion: give max (an absolute bound: metric <= max) or max_vs_control (metric <= the "
                        "control's value x max_vs_control), not both")
        return None
    if not bounds and isinstance(data, dict) and not {"max", "max_vs_control"} & set(data):
        problems.append("criterion.max: missing: give max = 3.35 (metric <= 3.35) or max_vs_control = 1.02 (metric "
                        "<= 1.02 x the control's value)")
    if values.get("max_vs_control", 1.0) <= 0:
        problems.append(f"criterion.max_vs_control: a factor of the control's value, must be > 0, got "
                        f"{values.pop('max_vs_control')}")
    return values


def read_early_stop(data: Any, problems: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(where, valid values) of every [[early_stop]] table."""
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        problems.append("early_stop: expected an array of tables ([[early_stop]])")
        return []
    rules = []
    for i, table in enumerate(data):
        where = f"early_stop[{i}]"
        values = read_measure_keys(table, EARLY_STOP_KEYS, where, problems)
        if "above" in values:
            values["above"] = float(values["above"])
        rules.append((where, values))
    return rules


def read_measure_keys(data: Any, schema: dict, where: str, problems: list[str]) -> dict[str, Any]:
    """The keys every measure has: metric (one of METRICS), step (>= 1), window (the training
    loss's only, and needed there)."""
    values = read_table(data, schema, where, problems)
    check_choice(values, "metric", METRICS, where, problems)
    check_minimum(values, "step", 1, where, problems)
    check_minimum(values, "window", 1, where, problems)
    metric = values.get("metric")
    if metric == VALIDATION and "window" in values:
        problems.append(f"{where}.window: only for metric = 'loss' (the validation loss is already a mean over "
                        "validation.steps batches); remove it")
        del values["window"]
    if metric == TRAIN_LOSS and "window" not in values and isinstance(data, dict) and "window" not in data:
        problems.append(f"{where}.window: missing: metric = 'loss' is the mean training loss over the `window` steps "
                        "ending at `step` (one step is noisy); e.g. window = 100")
    return values


# ---------------------------------------------------------------------------------------------
# Second pass: can the runs measure it?


def resolve_criterion(values: dict[str, Any] | None, runs: Frequencies, problems: list[str]) -> Criterion | None:
    """The Criterion of the table's values, its step defaulting to the last; None (with the
    problems) when it cannot be measured."""
    if not values or "metric" not in values or not {"max", "max_vs_control"} & set(values):
        return None
    measure = resolve_measure(values, "criterion", runs, problems, default_step=runs.steps)
    if measure is None:
        return None
    return Criterion(measure=measure, max=values.get("max"), max_vs_control=values.get("max_vs_control"))


def resolve_rules(rules: list[tuple[str, dict[str, Any]]], runs: Frequencies, problems: list[str]) -> list[StopRule]:
    found = []
    for where, values in rules:
        if not {"metric", "step", "above"} <= set(values):
            continue
        measure = resolve_measure(values, where, runs, problems)
        if measure is not None:
            found.append(StopRule(measure=measure, above=values["above"], where=where))
    return found


def resolve_measure(values: dict[str, Any], where: str, runs: Frequencies, problems: list[str],
                    default_step: int | None = None) -> Measure | None:
    step = values.get("step", default_step)
    metric = values["metric"]
    window = values.get("window")
    if step is None or (metric == TRAIN_LOSS and window is None):
        return None
    found = step_problems(metric, step, window, where, runs)
    problems += found
    return None if found else Measure(metric=metric, step=step, window=window)


def step_problems(metric: str, step: int, window: int | None, where: str, runs: Frequencies) -> list[str]:
    """Why `metric` cannot be read at `step` in the runs: beyond the last step, no validation
    then, or no logged training step in the window."""
    if step > runs.steps:
        return [f"{where}.step: {step} is beyond the training steps (plan.steps = {runs.steps}); choose a step in "
                f"1..{runs.steps}"]
    if metric == VALIDATION:
        if runs.validation_freq is None:
            return [f"{where}.metric: 'validation/loss' needs validation in every run; set \"validation.enable\" = "
                    "true in plan.overrides (or use metric = 'loss')"]
        if step % runs.validation_freq and step != runs.steps:
            return [f"{where}.step: the runs validate every {runs.validation_freq} steps (validation.freq) and at "
                    f"the last step {runs.steps}, not at step {step}; use a multiple of {runs.validation_freq} or "
                    f"{runs.steps}"]
        return []
    if window > step:
        return [f"{where}.window: {window} steps ending at step {step} would start before step 1; at most {step}"]
    if not any(logged(s, runs) for s in range(step - window + 1, step + 1)):
        return [f"{where}.window: no training step in {step - window + 1}..{step} is logged (metrics.log_freq = "
                f"{runs.log_freq}); widen the window or lower metrics.log_freq"]
    return []


def logged(step: int, runs: Frequencies) -> bool:
    """Whether the trainer logs this step's training loss: trainer.metrics.should_log, repeated
    here so that reading a plan does not import torch."""
    if step in (1, runs.steps):
        return True
    return runs.log_freq > 0 and step % runs.log_freq == 0
