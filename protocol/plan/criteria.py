"""What a set must reach, and when a run is not worth finishing: the `[criterion]` and
`[[early_stop]]` tables.

    [criterion]                     # judges every set: pass = meets it
    metric = "validation/loss"      # or "loss": the training loss averaged over `window` steps
    step = 20000                    # default: plan.steps
    max_vs_control = 1.02           # metric <= the control's value x 1.02 (or max = 3.35: metric <= 3.35,
                                    # or max_sigmas_above_control = 3: metric <= the control's value + 3 sigma)

    [[early_stop]]                  # checked while a set runs; a breaking run is stopped
    step = 5000
    metric = "validation/loss"
    above = 3.8

Both read a `Measure` from a run's metrics.jsonl (protocol.plan.measure). Reading is in two passes, as
for every table of a plan: the table's own keys first (types, choices, one bound), then, once
the plan's steps and the runs' validation and logging frequencies are known, whether the step
can be measured at all (protocol.plan.load). Every problem names its key and what would be valid.

A bound in units of noise. `max_sigmas_above_control = k` bounds the measure by the control's
value + k sigma, sigma the noise SD of the measure for one more run of the control family (the
control and its K noise controls, which statistical mode runs): with s the sample standard
deviation of the K + 1 members' values of the measure, sigma = s sqrt(1 + 1/(K + 1)), the form
protocol.verdict.decision gives a new member's offset from the family. A correct set is one more such
member; the bound starts from the control's one value, whose own noise adds to the set's, so a
correct set misses it somewhat more often than a t quantile says: 2.9% for k = 3 and 0.5% for
k = 5 with 4 noise controls (simulated, normal noise). A relative factor has no such meaning:
1.02 of a validation loss near 4.4 allows 0.09 nats, hundreds of times the rounding noise of a
CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.plan.schema import CRITERION_KEYS, EARLY_STOP_KEYS, METRICS, check_choice, check_minimum, read_table

VALIDATION, TRAIN_LOSS = METRICS
NOISE_BOUND = "max_sigmas_above_control"
BOUNDS = ("max", "max_vs_control", NOISE_BOUND)


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
    """metric <= max (absolute), metric <= the control's value of it x max_vs_control, or metric
    <= the control's value + max_sigmas_above_control x sigma (sigma: the module docstring)."""

    measure: Measure
    max: float | None = None
    max_vs_control: float | None = None
    max_sigmas_above_control: float | None = None

    @property
    def relative(self) -> bool:
        """Whether the bound depends on the control's value."""
        return self.max_vs_control is not None or self.in_sigmas

    @property
    def in_sigmas(self) -> bool:
        """Whether the bound is stated in noise SDs (it then needs the control family's sigma)."""
        return self.max_sigmas_above_control is not None

    def threshold(self, control_value: float | None, sigma: float | None = None) -> float | None:
        """The bound a set's value must not exceed; None for a relative criterion without the
        control's value (or, in noise SDs, without sigma)."""
        if not self.relative:
            return self.max
        if control_value is None:
            return None
        if self.in_sigmas:
            return None if sigma is None else control_value + self.max_sigmas_above_control * sigma
        return control_value * self.max_vs_control

    def describe(self, control_value: float | None = None, sigma: float | None = None) -> str:
        """'validation/loss at step 20000 <= 1.02 x control (3.28 -> 3.3456)', or '... <= control
        + 3 sigma (3.28 + 3 x 0.0021 -> 3.2863)'; the bracket only once the numbers are known."""
        if not self.relative:
            return f"{self.measure.describe()} <= {self.max:g}"
        if self.in_sigmas:
            text = f"{self.measure.describe()} <= control + {self.max_sigmas_above_control:g} sigma"
            if control_value is not None and sigma is not None:
                text += (f" ({control_value:.5g} + {self.max_sigmas_above_control:g} x {sigma:.3g} -> "
                         f"{self.threshold(control_value, sigma):.5g})")
            elif control_value is not None:
                text += f" (control {control_value:.5g})"
            return text
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


def read_criterion(data: Any, problems: list[str], mode: str = "exact") -> dict[str, Any] | None:
    """The [criterion] table's valid values (None without the table); a missing or doubled bound,
    a misplaced window and a bound in noise SDs without noise controls (`mode`: the plan's
    tolerance mode) are problems."""
    if data is None:
        return None
    values = read_measure_keys(data, CRITERION_KEYS, "criterion", problems)
    for key in BOUNDS:
        if key in values:
            values[key] = float(values[key])
    bounds = [key for key in BOUNDS if key in values]
    if len(bounds) > 1:
        problems.append(f"criterion: give one bound, not {' and '.join(bounds)}: max (an absolute bound: metric <= "
                        "max), max_vs_control (metric <= the control's value x max_vs_control) or "
                        f"{NOISE_BOUND} (metric <= the control's value + that many noise SDs)")
        return None
    if not bounds and isinstance(data, dict) and not set(BOUNDS) & set(data):
        problems.append(f"criterion.max: missing: give max = 3.35 (metric <= 3.35), max_vs_control = 1.02 (metric "
                        f"<= 1.02 x the control's value) or {NOISE_BOUND} = 3 (metric <= the control's value + 3 "
                        "noise SDs; statistical mode)")
    if values.get("max_vs_control", 1.0) <= 0:
        problems.append(f"criterion.max_vs_control: a factor of the control's value, must be > 0, got "
                        f"{values.pop('max_vs_control')}")
    problems += noise_bound_problems(values, mode)
    return values


def noise_bound_problems(values: dict[str, Any], mode: str) -> list[str]:
    """A bound in noise SDs needs a positive count and noise controls to measure sigma: only
    statistical mode runs them, and without them the bound could never be computed (every set
    would end 'not judged' after the whole plan ran), so the plan is refused as it is read."""
    if NOISE_BOUND not in values:
        return []
    if values[NOISE_BOUND] <= 0:
        return [f"criterion.{NOISE_BOUND}: noise SDs above the control's value, must be > 0, got "
                f"{values.pop(NOISE_BOUND)}"]
    if mode != "statistical":
        return [f"criterion.{NOISE_BOUND}: sigma is measured from the control's noise controls, which only "
                f"[tolerance] mode = \"statistical\" runs (this plan's mode is {mode!r}); set mode = \"statistical\" "
                "(noise_controls >= 2), or give max_vs_control or max instead"]
    return []


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
    if not values or "metric" not in values or not set(BOUNDS) & set(values):
        return None
    measure = resolve_measure(values, "criterion", runs, problems, default_step=runs.steps)
    if measure is None:
        return None
    return Criterion(measure=measure, **{key: values.get(key) for key in BOUNDS})


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
    """Whether the trainer logs this step's training loss: trainer.metrics.step_log.should_log, repeated
    here so that reading a plan does not import torch."""
    if step in (1, runs.steps):
        return True
    return runs.log_freq > 0 and step % runs.log_freq == 0
