"""What a plan's report is built from: each run's curve, or why it has none, and each run's own
record (layout, steps, code), never the plan's current text.

A run that failed or was skipped by `protocol run`, or that has no metrics.jsonl, becomes a
FAILED or NOT RUN row. Runs whose record differs from what the plan would run now are described
as they ran, with the differences noted (protocol.reuse decides what differs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.compare import NotCompared
from protocol.curves import Curve
from protocol.launch import RunResult
from protocol.plan import Launch, Plan
from protocol.records import RunInfo, read_record, run_info
from protocol.reuse import STALE, assess

METRICS_FILE = "metrics.jsonl"
Reader = Callable[[Path, str], Curve]


@dataclass
class Found:
    """The curves of a plan's runs, the runs without one, and every run as recorded."""

    controls: list[Curve] = field(default_factory=list)
    tests: list[Curve] = field(default_factory=list)
    not_compared: list[NotCompared] = field(default_factory=list)
    runs: list[RunInfo] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)
    control_names: list[str] = field(default_factory=list)

    def control_note(self, needed: int) -> str:
        """Why there is nothing to compare against: which control runs are missing and why."""
        missing = "; ".join(f"{m.name} {m.verdict} ({m.reason})" for m in self.not_compared
                            if m.name in self.control_names)
        if needed == 1:
            return f"nothing to compare against: the control run {missing}"
        return (f"nothing to compare against: statistical mode needs {needed} control runs, {len(self.controls)} "
                f"completed ({missing})")


def gather(plan: Plan, results: Sequence[RunResult], reader: Reader) -> Found:
    """Curves and records of every training run of the plan, in launch order."""
    outcome = {result.name: result for result in results}
    launches = plan.launches()
    training = [launch for launch in launches if launch.role != "seed"]
    records = {launch.name: read_record(launch.output) for launch in training}
    control = records[training[0].name]
    found = Found(control_names=[launch.name for launch in training if launch.role == "control"])
    found.runs = [run_info(launch.name, launch.output, records[launch.name], control) for launch in training]
    found.notes = stale_notes(plan, launches, records)
    for launch in training:
        missing = why_missing(launch, outcome.get(launch.name), records[launch.name])
        if missing:
            found.not_compared.append(NotCompared(launch.name, *missing))
        elif launch.role == "control":
            found.controls.append(reader(launch.output, launch.name))
        else:
            found.tests.append(reader(launch.output, launch.name))
    return found


def why_missing(launch: Launch, result: RunResult | None, record: dict | None) -> tuple[str, str] | None:
    """(verdict, reason) of a run that has no curve to compare, or None: it failed or was skipped
    in this `protocol run`, its own record says it failed, or it never wrote metrics."""
    if result is not None and not result.ok:
        return ("FAILED" if result.status == "failed" else "NOT RUN"), result.message
    if record is not None and record.get("status") == "failed":
        error = str(record.get("error") or "no error recorded").splitlines()[0]
        return "FAILED", f"its run record says failed at step {record.get('last_step')}: {error}"
    if not (launch.output / METRICS_FILE).is_file():
        return "NOT RUN", f"no {METRICS_FILE} in {launch.output}"
    return None


def stale_notes(plan: Plan, launches: list[Launch], records: dict[str, dict | None]) -> dict[str, list[str]]:
    """Run name -> what differs between its record and what the plan would run now."""
    decisions = assess(plan, launches)
    return {name: list(decision.differences) for name, decision in decisions.items()
            if decision.action == STALE and records.get(name) is not None}


def folder_layouts(paths: dict[str, Path], control: str) -> dict[str, str]:
    """For `protocol compare --control DIR --test NAME=DIR`: each run's layout from its record,
    when its folder has one (another trainer's folders have none)."""
    records = {name: read_record(path if path.is_dir() else path.parent) for name, path in paths.items()}
    control_record = records.get(control)
    return {name: run_info(name, path, records[name], control_record).layout
            for name, path in paths.items() if records[name] is not None}
