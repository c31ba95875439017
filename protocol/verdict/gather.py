"""What a plan's report is built from: each run's curve, or why it has none, and each run's own
record (layout, steps, code), never the plan's current text.

A run that failed or was skipped by `protocol run`, or that has no metrics.jsonl, becomes a
FAILED or NOT RUN row; a run an early-stop rule ended, a STOPPED row naming the rule. Runs whose
record differs from what the plan would run now are described as they ran, with the differences
noted (`Found.notes`: protocol.run.reuse.stale_notes decides what differs, and `protocol compare`
fills them in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from protocol.plan.criteria import StopRule
from protocol.plan.early_stop import applies, stopped
from protocol.plan.model import Launch, Plan
from protocol.plan.records import read_record
from protocol.plan.select import select
from protocol.verdict.curves import Curve
from protocol.verdict.results import NotCompared
from protocol.verdict.run_info import RunInfo, run_info

METRICS_FILE = "metrics.jsonl"
FAMILY_ROLES = ("control", "noise")
Reader = Callable[[Path, str], Curve]


class Outcome(Protocol):
    """What `protocol run` says of one launch (protocol.run.outcome.RunResult is one): its status
    ("completed", "failed", "skipped", "stopped", ...), why, and whether it left a usable run."""

    name: str
    status: str
    message: str

    @property
    def ok(self) -> bool: ...


@dataclass
class Found:
    """The curves of a plan's runs, the runs without one, and every run as recorded."""

    controls: list[Curve] = field(default_factory=list)
    """The control family with a curve: the control, then its noise controls."""
    tests: list[Curve] = field(default_factory=list)
    not_compared: list[NotCompared] = field(default_factory=list)
    runs: list[RunInfo] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)
    """Run name -> what differs between its record and what the plan would run now."""
    control_names: list[str] = field(default_factory=list)
    expect: dict[str, str] = field(default_factory=dict)
    """Set name -> "fail" for positive controls."""
    localize_only: set[str] = field(default_factory=set)
    """Sets whose fingerprints only say where they part (fingerprints = "localize")."""

    def layouts(self) -> dict[str, str]:
        return {run.name: run.layout for run in self.runs}

    def control_note(self, needed: int) -> str:
        """Why there is nothing to compare against: which control runs are missing and why."""
        missing = "; ".join(f"{m.name} {m.verdict} ({m.reason})" for m in self.not_compared
                            if m.name in self.control_names)
        if needed == 1:
            return f"nothing to compare against: the control run {missing}"
        return (f"nothing to compare against: statistical mode needs the control and at least {needed - 1} noise "
                f"controls, {len(self.controls)} completed ({missing})")


def gather(plan: Plan, results: Sequence[Outcome], reader: Reader, only: Sequence[str] | None = None) -> Found:
    """Curves and records of every training run of the plan, in launch order; with `only`, of the
    control family and the named sets (names or folder slugs) only."""
    outcome = {result.name: result for result in results}
    launches = plan.launches()
    training = [launch for launch in launches if launch.role != "seed"]
    if only:
        chosen = select(training, only)
        training = [launch for launch in training if launch.role != "test" or launch in chosen]
    records = {launch.name: read_record(launch.output) for launch in training}
    control = records[training[0].name]
    found = Found(control_names=[launch.name for launch in training if launch.role in FAMILY_ROLES],
                  expect={launch.name: launch.expect for launch in training if launch.role == "test"},
                  localize_only={spec.name for spec in plan.sets if spec.fingerprints == "localize"})
    found.runs = [run_info(launch.name, launch.output, records[launch.name], control) for launch in training]
    for launch in training:
        missing = why_missing(launch, outcome.get(launch.name), records[launch.name], plan.early_stop)
        if missing:
            found.not_compared.append(NotCompared(launch.name, *missing))
        elif launch.role in FAMILY_ROLES:
            found.controls.append(reader(launch.output, launch.name))
        else:
            found.tests.append(reader(launch.output, launch.name))
    return found


def numerics_warnings(runs: Sequence[RunInfo]) -> list[str]:
    """Exact mode compares step by step, which only deterministic fp32 runs can pass: say so
    for every run that is not one."""
    odd = [f"{run.name} ({run.numerics})" for run in runs if run.numerics and run.numerics != "float32, deterministic"]
    if not odd:
        return []
    return [f"exact mode expects deterministic float32 runs, but {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} "
            "not: their steps can differ by rounding alone; use mode = \"statistical\" for such runs"]


def why_missing(launch: Launch, result: Outcome | None, record: dict | None,
                rules: Sequence[StopRule] = ()) -> tuple[str, str] | None:
    """(verdict, reason) of a run that has no curve to compare, or None: an early-stop rule ended
    it, it failed or was skipped in this `protocol run`, its own record says it failed, or it
    never wrote metrics."""
    if result is not None and result.status == "stopped":
        return "STOPPED", result.message
    breach = stopped(launch.output, rules) if applies(launch) else None
    if breach is not None:
        return "STOPPED", breach.describe()
    if result is not None and not result.ok:
        return ("FAILED" if result.status == "failed" else "NOT RUN"), result.message
    if record is not None and record.get("status") == "failed":
        error = str(record.get("error") or "no error recorded").splitlines()[0]
        return "FAILED", f"its run record says failed at step {record.get('last_step')}: {error}"
    if not (launch.output / METRICS_FILE).is_file():
        return "NOT RUN", f"no {METRICS_FILE} in {launch.output}"
    return None
