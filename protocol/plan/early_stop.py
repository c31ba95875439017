"""Early stopping: a set's run whose measure breaks a `[[early_stop]]` rule is stopped, and its
folder says so.

The launchers call `breach(rules, folder)` while they wait for a run (protocol.run.local at every
progress poll, protocol.run.slurm at every look at the queue). Once a rule's step has been measured
and the value is above the rule's bound (or not a number: a diverged run), the run is ended and
`<run>/.protocol-stopped` is written (protocol.run.folders.mark_stopped, with `marker_text`): one
JSON line with the rule, the value that broke it, the step the run had reached and when.

The marker stands while the rule that broke it is still in the plan with the same values: the run
is then STOPPED for `protocol run` (not run again) and `protocol compare` (not a failure of the
run). A plan whose rules no longer hold that rule runs it again; it resumes from its last
checkpoint in its folder, like any unfinished run.

Only test sets are stopped: the control and its noise controls are the reference every set and a
relative criterion is measured against.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.plan.criteria import StopRule
from protocol.plan.measure import measure, read_records

STOP_MARKER = ".protocol-stopped"


@dataclass(frozen=True)
class Breach:
    """A rule a run broke, and the value it had."""

    rule: StopRule
    value: float
    last_step: int | None = None

    def describe(self) -> str:
        """'early_stop[0]: validation/loss at step 5000 = 3.91 > 3.8 (stopped at step 5003)'."""
        at = f" (stopped at step {self.last_step})" if self.last_step is not None else ""
        return f"{self.rule.where}: {self.rule.measure.describe()} = {self.value:.5g} > {self.rule.above:g}{at}"


def applies(launch) -> bool:
    """Rules stop test sets only, never the control family they are compared with."""
    return launch.role == "test"


def breach(rules: Sequence[StopRule], folder: Path) -> Breach | None:
    """The first rule the run in `folder` breaks now, with its value; None while none is broken
    (a rule whose step the run has not measured yet is not broken)."""
    if not rules:
        return None
    records = read_records(folder)
    for rule in rules:
        value = measure(records, rule.measure).value
        if value is not None and not value <= rule.above:  # NaN breaks every rule
            return Breach(rule, value, records.last_step)
    return None


def marker_text(found: Breach, when: str) -> str:
    """The STOP_MARKER line of a run stopped at `when` by `found` (what `stopped` reads back)."""
    return json.dumps({"rule": found.rule.to_dict(), "where": found.rule.where, "value": found.value,
                       "last_step": found.last_step, "stopped": when}) + "\n"


def stopped(folder: Path, rules: Sequence[StopRule]) -> Breach | None:
    """The breach the folder's marker records, while the rule it names is still among `rules`
    with the same values; None when the run was not stopped or its rule has changed."""
    try:
        marker = json.loads((Path(folder) / STOP_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    rule = next((rule for rule in rules if rule.to_dict() == marker.get("rule")), None)
    value = marker.get("value")
    if rule is None or not isinstance(value, (int, float)):
        return None
    last = marker.get("last_step")
    return Breach(rule, float(value), last if isinstance(last, int) else None)
