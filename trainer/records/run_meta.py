"""The record of a run in its dump folder: run_meta.json and metrics.jsonl, kept together.

A *run* is the training history of one dump folder: its first start and every resume after it.

- `run_meta.json` describes the run as it is now: the resolved configuration of the latest start,
  the code that ran (trainer.version), what the latest start loaded (`start`), its status, and
  under `history` the records of the earlier starts of the same run (oldest first).
- `metrics.jsonl` holds each step once, of one training trajectory. A resume from step S moves
  the records of steps after S (from an attempt that was cut off, or steps that are trained
  again) out of it.
- A new run in a folder that holds another run's record, or a start from a checkpoint of another
  trajectory than the record's (see `begin`), moves that record (run_meta.json, metrics.jsonl and
  fingerprints.jsonl together) to `previous/<time>/`; nothing is deleted.
- `fingerprints.jsonl` (metrics.fingerprints) follows metrics.jsonl: one line per recorded step.

Record fields (format 2), written by the rank that logs:

    format        2
    status        "running" (also what a killed run leaves), "completed" (reached training.steps),
                  "data ended" (a finite dataset ended with training.dataset_end = "stop"),
                  "failed" (an error stopped it; see "error"), "interrupted" (it saved its
                  last step on checkpoint.save_on_signal and stopped: a new start resumes)
    started, ended   ISO times (ended is null while running)
    last_step     the last step trained (updated when the run ends)
    config        the resolved configuration (trainer.config.manager.to_dict)
    code          trainer.version.code_version(): commit, dirty, source_sha256
    start         what this start loaded: {"kind": "init" | "checkpoint" | "resume" | "hugging_face",
                  "path": str | null, "step": int, "fingerprint": str | null}
    tensorboard   the run's TensorBoard folder relative to the dump folder (null when disabled)
    world_size, degrees, global_batch_size, accumulation_steps, device, torch, python,
    num_params, data, validation_data
    device_name   the GPU's name (CUDA) or the CPU's
    cuda, nccl    the versions torch was built with (null off CUDA)
    argv          the trainer's own command-line options (the launcher passes them through)
    warnings      every warning this start was given, each once, as printed (trainer/messages.py):
                  options of the configuration that were ignored, data or checkpoint notes
    trajectory    the training trajectory this start's steps belong to: {"lineage", "ancestors"}
                  (trainer/checkpoint/lineage.py); a start on another trajectory than the
                  record's moves the record aside instead of continuing it (see `begin`)
    metrics_from_step   set when metrics.jsonl starts after step 1: a start from a checkpoint at
                  step S whose steps 1..S are not recorded in this folder (it came from elsewhere)
    completed_at_restart, error_before_restart   set when a later start found the run complete
                  (it stopped after its final save, or its exports could not be written then and
                  were written by that start; the error of then is kept)
    restart       which automatic restart of the launcher this start is: 0 for the job's first
                  start, K for its K-th restart after a failure (TORCHELASTIC_RESTART_COUNT); a
                  restart resumes from the latest checkpoint, so the start it replaced is the
                  last entry of `history` (status "running": it was killed); a restart before
                  the first checkpoint starts the run anew (the killed start goes to previous/)
    history       earlier records of this run, oldest first (each without its own history)

Torch-free: the protocol reads records with `read_record`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from trainer.records.untrusted_json import RecordError, check_run_record, read_object
from trainer.messages import kept_warnings
from trainer.records.safe_writes import refuse_link, write_atomic

RECORD_FILE = "run_meta.json"
METRICS_FILE = "metrics.jsonl"
FINGERPRINTS_FILE = "fingerprints.jsonl"  # trainer/metrics/fingerprints.py: kept with metrics.jsonl
# What a line of fingerprints.jsonl holds besides its step: per parameter, and per block.
PARAMETER_QUANTITIES = ("grad_norm", "update_norm", "param_norm")
BLOCK_QUANTITIES = ("output_rms", "grad_rms")
# Per block too: what its attention and its FFN add to the residual stream. Files written before
# they were recorded lack them; a reader takes a missing one as not recorded.
BRANCH_QUANTITIES = ("attention_rms", "ffn_rms")
STEP_FILES = (METRICS_FILE, FINGERPRINTS_FILE)  # one line per step
PREVIOUS_DIR = "previous"
FORMAT = 2
FINAL_STATUSES = ("completed", "data ended", "failed", "interrupted")


def refuse_links(folder: Path) -> None:
    """LinkRefused when a record file of `folder` is a link (or not a regular file): the run would
    refuse to write it later, after its start (trainer/records/safe_writes.py); the preflight asks first."""
    for name in (RECORD_FILE, *STEP_FILES):
        refuse_link(Path(folder) / name)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_record(folder: Path) -> dict | None:
    """The run record of a dump folder, or None when there is none or it is not one this trainer
    wrote (for readers of many folders: the protocol)."""
    try:
        return load_record(folder)
    except RecordError:
        return None


def load_record(folder: Path) -> dict | None:
    """The run record of a dump folder, or None when there is none; RecordError, naming the file
    and the field, when it is not what this trainer writes (the trainer, which continues it)."""
    file = Path(folder) / RECORD_FILE
    record = read_object(file)
    return None if record is None else check_run_record(file, record)


def write_record(folder: Path, record: dict) -> None:
    """Write run_meta.json atomically (a reader never sees half a file); values json cannot
    encode are str()-ed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / RECORD_FILE, json.dumps(record, indent=2, default=str) + "\n")


def begin(folder: Path, record: dict, resumed_step: int, trajectory: dict | None = None) -> dict:
    """Start (resumed_step == 0) or continue (resumed_step > 0) the run of `folder`; returns the
    record written, with status "running". `trajectory` ({"lineage", "ancestors"}, see
    trainer/checkpoint/lineage.py) names the training trajectory this start's steps belong to.

    Continuing the trajectory of the folder's record (`continues`): the earlier record goes into
    `history`, and metrics.jsonl keeps only steps <= resumed_step. Anything else (a new run, or a
    start from a checkpoint of another trajectory than the record's: a branch, a run that loads
    an older step, a return to the trajectory of the checkpoints after a run without them) moves
    the folder's record and step files whole to previous/<time>/; the new metrics.jsonl starts
    with steps 1..resumed_step of its own trajectory, taken from the newest record of it in
    previous/ (`trajectory_source`), so that it never holds two trajectories.
    """
    folder = Path(folder)
    earlier = load_record(folder) if resumed_step else None  # a new run moves it aside unread
    history: list = []
    if continues(earlier, resumed_step, trajectory):
        drop_metrics_after(folder, resumed_step)
        if earlier is not None:
            history = [*earlier.get("history", []), {k: v for k, v in earlier.items() if k != "history"}]
    else:
        archive(folder)
        source = trajectory_source(folder, resumed_step, trajectory) if resumed_step else None
        if source is not None:
            history = restore_steps(folder, source, resumed_step)
        elif resumed_step:
            record = {**record, "metrics_from_step": resumed_step + 1}
    if trajectory is not None:
        record = {**record, "trajectory": trajectory}
    record = {"format": FORMAT, "status": "running", "started": now(), "ended": None, "last_step": resumed_step,
              **record, "warnings": kept_warnings(), "history": history}
    write_record(folder, record)
    return record


def continues(earlier: dict | None, resumed_step: int, trajectory: dict | None) -> bool:
    """Whether a start from step `resumed_step` on `trajectory` continues the run recorded by
    `earlier`: it resumes (step > 0) the record's own trajectory. A folder without a record (it
    was removed), records of earlier versions, and callers that name no trajectory tell nothing:
    a resume continues them."""
    if resumed_step == 0:
        return False
    if earlier is None:
        return True
    theirs = (earlier.get("trajectory") or {}).get("lineage")
    return theirs is None or trajectory is None or theirs == trajectory["lineage"]


def on_trajectory(record: dict, step: int, trajectory: dict) -> bool:
    """Whether the steps 1..step of the run `record` describes are those of `trajectory`: the
    same lineage, or one it forked from at `step` or later."""
    theirs = (record.get("trajectory") or {}).get("lineage")
    if theirs is None:
        return False
    if theirs == trajectory["lineage"]:
        return True
    return any(a.get("lineage") == theirs and step <= a.get("until_step", -1) for a in trajectory.get("ancestors", []))


def trajectory_source(folder: Path, step: int, trajectory: dict | None) -> Path | None:
    """The newest folder of previous/ whose record's steps 1..step are those of `trajectory`."""
    if trajectory is None or not (Path(folder) / PREVIOUS_DIR).is_dir():
        return None
    candidates = sorted((Path(folder) / PREVIOUS_DIR).iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        record = read_record(candidate)
        if record is not None and on_trajectory(record, step, trajectory):
            return candidate
    return None


def restore_steps(folder: Path, source: Path, step: int) -> list:
    """Copy the lines of steps <= step from `source`'s step files into `folder` (the archive is
    left whole); returns the history of the source's run (its earlier starts and itself)."""
    for name in STEP_FILES:
        if (source / name).is_file():
            lines = [line if line.endswith("\n") else line + "\n"
                     for line in (source / name).read_text().splitlines(keepends=True) if line_step(line) <= step]
            write_atomic(Path(folder) / name, "".join(lines))
    record = read_record(source) or {}
    return [*record.get("history", []), {k: v for k, v in record.items() if k != "history"}]


def finish(folder: Path, record: dict, status: str, last_step: int, error: str | None = None) -> dict:
    """Write the final status of this start into the record; returns it."""
    record = {**record, "status": status, "ended": now(), "last_step": last_step, "warnings": kept_warnings()}
    if error:
        record["error"] = error
    write_record(folder, record)
    return record


def complete_after_final_save(folder: Path, last_step: int, exports_written: bool = False) -> bool:
    """A run killed after its final checkpoint but before its record said so ("running"), found
    complete at its next start: its record says "completed" now (with "completed_at_restart"),
    when metrics.jsonl holds its last step. `exports_written`: that start wrote the exports the
    run stopped before writing, so a record that says "failed" (an export that could not be
    written, a full disk) is completed too. Returns whether the record changed."""
    folder = Path(folder)
    record = load_record(folder)
    if record is None or record.get("status") == "completed":
        return False
    if record.get("status") in FINAL_STATUSES and not (exports_written and record.get("status") == "failed"):
        return False
    try:
        steps = [line_step(line) for line in (folder / METRICS_FILE).read_text().splitlines() if line.strip()]
    except OSError:
        return False
    if last_step not in steps:
        return False
    completed = {k: v for k, v in record.items() if k != "error"}
    if record.get("error"):  # what stopped the start before: kept, no longer the run's outcome
        completed["error_before_restart"] = record["error"]
    finish(folder, {**completed, "completed_at_restart": True}, "completed", last_step)
    return True


def archive(folder: Path) -> Path | None:
    """Move a previous run's run_meta.json and step files together to previous/<time>/."""
    folder = Path(folder)
    present = [folder / name for name in (RECORD_FILE, *STEP_FILES) if (folder / name).is_file()]
    if not present:
        return None
    stamp = datetime.fromtimestamp(max(p.stat().st_mtime for p in present)).strftime("%Y%m%d-%H%M%S")
    target = free_path(folder / PREVIOUS_DIR / stamp)
    target.mkdir(parents=True)
    for path in present:
        os.replace(path, target / path.name)
    return target


def drop_metrics_after(folder: Path, step: int) -> Path | None:
    """Keep the metrics.jsonl (and fingerprints.jsonl) records of steps <= step; move the others
    to previous/<time>-after-step-<step>/. Returns where they went, if anywhere."""
    target = None
    for name in STEP_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        kept, dropped = [], []
        for line in path.read_text().splitlines(keepends=True):
            (dropped if line_step(line) > step else kept).append(line if line.endswith("\n") else line + "\n")
        if not dropped:
            continue
        if target is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            target = free_path(Path(folder) / PREVIOUS_DIR / f"{stamp}-after-step-{step}")
            target.mkdir(parents=True)
        write_atomic(target / name, "".join(dropped))
        write_atomic(path, "".join(kept))
    return target


def line_step(line: str) -> int:
    """The step of a metrics.jsonl line; a line cut by a crash counts as after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return 1 << 62


def free_path(path: Path) -> Path:
    """`path`, or path-1, path-2, ... when it exists."""
    candidate, counter = path, 0
    while candidate.exists():
        counter += 1
        candidate = path.with_name(f"{path.name}-{counter}")
    return candidate
