"""The sweep tables of a plan with a [criterion]: for every sweep, one row per point (and the
control) with the synchronizations per forward pass the run counted, its value of the criterion's
measure, how far that is from the control's, whether it meets the criterion, and its time per
step; and the answer (the fewest syncs meeting the criterion).

Every number comes from the run folders (protocol.plan.measure): syncs from run_meta.json's
"collectives" (runs with metrics.count_collectives = true; "n/a" otherwise), the time per step
from metrics.jsonl, weighted over the steps after the run's learning-rate warm-up. The tables
are written out and printed by protocol.report.sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from protocol.plan.judging import Judgement
from protocol.plan.measure import Value, mean_step_time, read_records, syncs_per_forward
from protocol.plan.model import Launch, Plan
from protocol.plan.records import read_record
from protocol.plan.search import SearchOutcome
from protocol.plan.sweeps import Sweep


@dataclass
class Row:
    """One run of a sweep's table. meets: 'yes', 'no', 'STOPPED', 'FAILED', 'not run', 'not needed'
    (a search point the search did not need), or 'control'."""

    name: str
    syncs: float | None
    value: float | None
    vs_control: float | None
    meets: str
    step_time: float | None
    note: str = ""


@dataclass
class SweepTable:
    sweep: Sweep
    rows: list[Row]
    answer: str
    search: str = ""
    warnings: list[str] = field(default_factory=list)
    figure: Path | None = None


@dataclass
class SweepReport:
    criterion: str
    metric: str
    tables: list[SweepTable]


def run_figures(launch: Launch) -> tuple[float | None, float | None]:
    """(syncs per forward, time per step) of the run in the launch's folder."""
    record = read_record(launch.output)
    warmup = ((record or {}).get("config") or {}).get("lr_scheduler", {}).get("warmup_steps") or 0
    return syncs_per_forward(record), mean_step_time(read_records(launch.output), int(warmup))


def meets_cell(judged: Judgement | None, verdict: str | None, search: SearchOutcome | None) -> tuple[str, str]:
    """(the meets column, a note): the judgement when there is one, else why there is none."""
    if judged is not None and judged.stopped is not None:
        return "STOPPED", judged.stopped.describe()
    if verdict == "FAILED":
        return "FAILED", ""
    if judged is not None and judged.meets is not None:
        return ("yes" if judged.meets else "no"), ""
    if search is not None and judged is not None and judged.name not in search.visited:
        return ("not needed" if search.complete else "not run"), ""
    return "not run", judged.missing if judged is not None else ""


def sweep_table(plan: Plan, sweep: Sweep, control: Value, judgements: dict[str, Judgement],
                verdicts: dict[str, str], search: SearchOutcome | None) -> SweepTable:
    launches = {launch.name: launch for launch in plan.launches()}
    control_launch = next(launch for launch in launches.values() if launch.role == "control")
    syncs, step_time = run_figures(control_launch)
    rows = [Row(control_launch.name, syncs, control.value, None, "control", step_time)]
    for name in sweep.points:
        judged = judgements.get(name)
        value = judged.value if judged is not None else None
        syncs, step_time = run_figures(launches[name])
        meets, note = meets_cell(judged, verdicts.get(name), search)
        relative = value / control.value - 1 if value is not None and control.value else None
        rows.append(Row(name, syncs, value, relative, meets, step_time, note))
    table = SweepTable(sweep, rows, answer(rows[1:]), search.describe() if search else "")
    table.warnings = prefix_warnings(rows[1:]) if sweep.search else []
    return table


def answer(rows: list[Row]) -> str:
    """The fewest syncs among the points that meet the criterion; without counted syncs, the last
    point in the sweep's order (the least communication as written) that meets it."""
    meeting = [row for row in rows if row.meets == "yes"]
    if not meeting:
        return "no set meets the criterion"
    counted = [row for row in meeting if row.syncs is not None]
    if counted:
        best = min(counted, key=lambda row: (row.syncs, -rows.index(row)))
        return f"fewest syncs meeting the criterion: {best.syncs:g} ({best.name})"
    return (f"fewest syncs meeting the criterion: not counted (set metrics.count_collectives = true); the last point "
            f"in the sweep's order that meets it: {meeting[-1].name}")


def prefix_warnings(rows: list[Row]) -> list[str]:
    """A search assumes that the points meeting the criterion come first: say when the judged
    points show otherwise (then its answer may not be the last point that meets it)."""
    judged = [row for row in rows if row.meets in ("yes", "no", "STOPPED")]
    for before, after in zip(judged, judged[1:]):
        if before.meets != "yes" and after.meets == "yes":
            return [f"the points meeting the criterion are not a prefix of the sweep's order: {before.name} misses it, "
                    f"{after.name} after it meets it; the bisection assumes less communication never helps"]
    return []
