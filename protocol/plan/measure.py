"""Numbers read from a run folder: a criterion's or a rule's measure, the time per step, and the
tensor-parallel synchronizations per forward pass the run counted.

metrics.jsonl (trainer/metrics/step_log.py): training records have no "kind" key ("step", "loss",
"step_time_s": the mean time of the steps since the previous logged step, ...); validation
records have "kind": "validation" and "validation/loss". A run being written may end in half a
line, and a resumed run logs some steps again: unreadable lines are skipped and the line written
last wins, so the same reader serves a running run (early stopping) and a finished one.

run_meta.json (trainer.records.run_meta) holds, with `metrics.count_collectives = true`, a
"collectives" entry whose "tp_syncs_per_forward" is the measured number of tensor-parallel
synchronizations of one forward pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from protocol.plan.criteria import TRAIN_LOSS, Measure

METRICS_FILE = "metrics.jsonl"


@dataclass
class Records:
    """One run's metrics.jsonl, by step: training losses, step times and validation losses."""

    train_loss: dict[int, float] = field(default_factory=dict)
    step_time: dict[int, float] = field(default_factory=dict)
    validation: dict[int, float] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        """The furthest step the run has logged anything at (it validates between its logged
        training steps)."""
        return max(max(self.train_loss, default=0), max(self.validation, default=0))


@dataclass(frozen=True)
class Value:
    """A measure of one run: its value, or (value None) why it has none."""

    value: float | None
    missing: str = ""


def read_records(folder: Path) -> Records:
    """The run's metrics (empty when it has written none yet)."""
    records = Records()
    path = Path(folder) / METRICS_FILE
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            continue  # a line being written, or not JSON
        if isinstance(record, dict) and type(record.get("step")) is int:
            add(records, record)
    return records


def add(records: Records, record: dict) -> None:
    step = int(record["step"])
    if "kind" not in record:
        if is_number(record.get("loss")):
            records.train_loss[step] = float(record["loss"])
        if is_number(record.get("step_time_s")):
            records.step_time[step] = float(record["step_time_s"])
    elif record.get("kind") == "validation" and is_number(record.get("validation/loss")):
        records.validation[step] = float(record["validation/loss"])


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def measure(records: Records, what: Measure) -> Value:
    """The measure's value, or why there is none yet (the run has not reached it, or the metric
    was not logged there)."""
    if what.metric == TRAIN_LOSS:
        if records.last_step < what.step:
            return Value(None, f"the run reached step {records.last_step}, not {what.step}")
        first = what.step - (what.window or 1) + 1
        window = [loss for step, loss in records.train_loss.items() if first <= step <= what.step]
        if not window:
            return Value(None, f"no training loss logged in steps {first}-{what.step}")
        return Value(sum(window) / len(window))
    if what.step in records.validation:
        return Value(records.validation[what.step])
    last = max(records.validation, default=None)
    seen = f"last validation at step {last}" if last is not None else "no validation logged"
    return Value(None, f"no {what.metric} at step {what.step} ({seen})")


def mean_step_time(records: Records, warmup: int) -> float | None:
    """Seconds per training step after the first `warmup` steps (at least step 1, which holds the
    first-step overheads): every logged record covers the steps since the previous one, so the
    intervals that begin at or after the warm-up are weighted by the steps they cover."""
    steps = sorted(records.step_time)
    start = max(warmup, 1)
    total = covered = 0.0
    for before, step in zip(steps, steps[1:]):
        if before >= start:
            total += records.step_time[step] * (step - before)
            covered += step - before
    return total / covered if covered else None


def syncs_per_forward(record: dict | None) -> float | None:
    """The tensor-parallel syncs per forward pass the run counted (metrics.count_collectives),
    None when it did not count them."""
    collectives = (record or {}).get("collectives")
    value = collectives.get("tp_syncs_per_forward") if isinstance(collectives, dict) else None
    return float(value) if is_number(value) and math.isfinite(value) else None
