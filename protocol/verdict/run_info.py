"""What a run did, told from its own record (`<dump_folder>/run_meta.json`, trainer.records.run_meta).

The report describes each run from this record, never from the plan's current text: a run made
before the plan was edited shows the options it really ran with. A run's layout is its recorded
degrees plus the options in which its recorded configuration differs from the control's,
leaving out what differs by construction (dump folder, the seed of the control's repeats, the
degrees themselves, the checkpoint it loaded, the seed of its rounding-level perturbation).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.plan.model import RUN_MARKER, describe_degrees
from protocol.plan.records import config_changes, flat, show

# Options that differ between the runs of one plan by construction, or are shown as degrees.
BY_CONSTRUCTION = {"job.dump_folder", "debug.seed", "checkpoint.initial_load_path",
                   "parallelism.pipeline_parallel_schedule", "debug.init_perturbation_seed"}
# Options left out of a run's configuration differences: its folder, and (statistical plans) the
# seed of its own rounding-level perturbation, which every run has and which its command shows.
UNSHOWN = {"job.dump_folder", "debug.init_perturbation_seed"}


@dataclass(frozen=True)
class RunInfo:
    """One run as its record describes it, for reports (None: not recorded)."""

    name: str
    folder: str
    layout: str
    steps: int | None = None
    status: str | None = None
    code: str | None = None
    torch: str | None = None
    world_size: int | None = None
    recorded: bool = True
    command: str | None = None
    """The command that started it: the protocol's launch (its folder's marker), else the trainer's options."""
    python: str | None = None
    device: str | None = None
    """Device type and name, e.g. 'cuda (NVIDIA H100 80GB HBM3)' or 'cpu (AMD EPYC)'."""
    cuda: str | None = None
    nccl: str | None = None
    start: str | None = None
    """What its first start loaded: 'seed checkpoint 3f2a1c9d (path)', or 'initialized'."""
    config_changes: tuple[str, ...] = ()
    """Every option in which its configuration differs from the control's ('key old -> new')."""
    numerics: str | None = None
    """'float32, deterministic' or what else it computed in (exact mode wants those)."""

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "layout": self.layout, "steps": self.steps, "status": self.status,
                "code": self.code, "torch": self.torch, "world_size": self.world_size, "recorded": self.recorded,
                "command": self.command, "python": self.python, "device": self.device, "cuda": self.cuda,
                "nccl": self.nccl, "start": self.start, "config_changes": list(self.config_changes),
                "numerics": self.numerics}


def is_degree(key: str) -> bool:
    return key.startswith("parallelism.") and key.endswith("_degree")


def layout(record: dict, control: dict | None) -> str:
    """'dp_shard 2, tp 2, pp 2 (Interleaved1F1B) + parallelism.pipeline_parallel_microbatch_size=2'."""
    config = flat(record.get("config"))
    degrees = dict(record.get("degrees") or {})
    if degrees.get("pp", 1) > 1:
        degrees["pp_schedule"] = config.get("parallelism.pipeline_parallel_schedule")
    options = []
    if control is not None and control is not record:
        changes = config_changes(control.get("config"), record.get("config"), BY_CONSTRUCTION)
        options = [f"{key}={show(new)}" for key, _, new in changes if not is_degree(key)]
    return " + ".join([describe_degrees(degrees) if degrees else "degrees not recorded", *options])


def code_label(code: dict | None) -> str | None:
    from trainer.version import describe

    return describe(code) if code else None


def run_info(name: str, folder: Path, record: dict | None, control: dict | None) -> RunInfo:
    """The report's description of a run from its record (and the control's, for its options)."""
    if record is None:
        return RunInfo(name, str(folder), "not recorded (no run_meta.json)", recorded=False)
    changes = config_changes(control.get("config"), record.get("config"), UNSHOWN) \
        if control is not None and control is not record else []
    return RunInfo(name, str(folder), layout(record, control), steps=record.get("last_step"),
                   status=record.get("status"), code=code_label(record.get("code")), torch=record.get("torch"),
                   world_size=record.get("world_size"), command=run_command(folder, record),
                   python=record.get("python"), device=device_label(record), cuda=record.get("cuda"),
                   nccl=record.get("nccl"), start=start_label(first_start(record)),
                   config_changes=tuple(f"{key} {show(old)} -> {show(new)}" for key, old, new in changes),
                   numerics=numerics(record))


def first_start(record: dict) -> dict:
    """The record of the run's first start (a resumed run keeps earlier starts in history)."""
    history = record.get("history") or []
    return history[0] if history else record


def run_command(folder: Path, record: dict) -> str | None:
    """The launch the protocol wrote into the folder's marker, else `trainer.train` with the
    options the trainer recorded."""
    try:
        marker = json.loads((Path(folder) / RUN_MARKER).read_text())
        if isinstance(marker, dict) and marker.get("command"):
            return str(marker["command"])
    except (OSError, ValueError):
        pass
    argv = record.get("argv")
    if isinstance(argv, list):
        return "python -m trainer.train " + shlex.join(str(a) for a in argv)
    return None


def device_label(record: dict) -> str | None:
    device, name = record.get("device"), record.get("device_name")
    if device is None:
        return None
    return f"{str(device).split(':')[0]} ({name})" if name else str(device)


def start_label(record: dict) -> str | None:
    start = record.get("start") or {}
    if not start:
        return None
    if start.get("kind") == "init":
        return "initialized (no checkpoint)"
    fingerprint = str(start.get("fingerprint") or "")[:8] or "no fingerprint"
    return f"{start.get('kind')} {fingerprint} ({start.get('path')}, step {start.get('step')})"


def numerics(record: dict) -> str | None:
    config = flat(record.get("config"))
    if not config:
        return None
    dtype = config.get("training.mixed_precision_param")
    if dtype == "auto":
        dtype = "bfloat16" if str(record.get("device", "")).startswith("cuda") else "float32"
    deterministic = "deterministic" if config.get("debug.deterministic") else "not deterministic"
    return f"{dtype}, {deterministic}"


def code_summary(runs: list[RunInfo]) -> str | None:
    """'3f2a1c9d (every run)' or '3f2a1c9d (control, tp2); 8b0e44aa (pp2)'; None when no run
    recorded its code."""
    by_code: dict[str, list[str]] = {}
    for run in runs:
        by_code.setdefault(run.code or "not recorded", []).append(run.name)
    if set(by_code) == {"not recorded"}:
        return None
    if len(by_code) == 1:
        return f"{next(iter(by_code))} (every run)"
    return "; ".join(f"{code} ({', '.join(names)})" for code, names in by_code.items())
