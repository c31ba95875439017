"""One checkpoint folder: its record (checkpoint.json), what it holds, the seed checkpoint, and
the errors of checkpoint handling. (trainer/checkpoint/manager.py decides what a run loads and saves.)"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.checksums import ChecksumWriter
from trainer.checkpoint.items import ModelState, aliased_names
from trainer.checkpoint.on_disk import CHECKPOINT_RECORD, is_full_checkpoint, partial_path, remove_checkpoint
from trainer.config.manager import to_dict
from trainer.checkpoint.dcp_read import saved_items, saved_keys
from trainer.records.safe_writes import write_atomic
from trainer.version import code_version


class CheckpointError(ValueError):
    """A checkpoint a user named or pointed at cannot be used; the message names it."""


class CheckpointWriteError(CheckpointError):
    """A save could not be written (no space left, a quota, a file-size limit). Not a user's
    configuration mistake, but a restart would fail the same way until someone frees space: it
    stops the run like one (exit 2, no automatic restart)."""


def save_error_text(error: BaseException, folder: Path | None = None) -> str:
    """The OS error under DCP's CheckpointException (one per failed rank), as a short text, and,
    when the filesystem of `folder` is full, that: torch's writer reports a write cut short by a
    full disk as "unexpected pos 704 vs 598", which names no cause."""
    if isinstance(error, CheckpointException):
        failures = {rank: failure[0] if isinstance(failure, tuple) else failure
                    for rank, failure in error.failures.items()}
        text = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    else:
        text = f"{type(error).__name__}: {error}"
    full = no_space_note(folder) if folder is not None else None
    return f"{full} ({text})" if full else text


def is_write_failure(error: BaseException) -> bool:
    """Whether a failed save failed writing (no space, a quota, a read-only folder), not because a
    peer died or a collective broke: only the first stops the run as a save that cannot be
    written; the others are the run's failure as they are (the launcher restarts it). DCP gathers
    what failed on each rank into a CheckpointException (torch's writer reports a full disk as a
    RuntimeError, "unexpected pos"); a broken collective reaches the surviving ranks as gloo's or
    NCCL's own error instead."""
    return isinstance(error, (CheckpointException, OSError))


@contextmanager
def every_rank_of(error: BaseException):
    """Around freeing the space a failed save took: when DCP raised `error` on every rank (a
    CheckpointException), all ranks meet before (each has looked at the disk for its message)
    and after (each writes its error report, for the launcher, once there is space for it)."""
    everyone = isinstance(error, CheckpointException)
    if everyone:
        dist.barrier()
    yield
    if everyone:
        dist.barrier()


# Less than this free on a filesystem after a failed write: it ran out of space.
FULL_BELOW_BYTES = 16 * 2**20


def no_space_note(folder: Path) -> str | None:
    """'no space left on device: N bytes free on the filesystem of <folder>' when it is (almost)
    full, else None (also when it cannot be asked)."""
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        stats = os.statvfs(existing)
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    if free >= min(FULL_BELOW_BYTES, stats.f_blocks * stats.f_frsize // 100):
        return None
    return f"no space left on device: {free} bytes free on the filesystem of {existing}"


class TrainingComplete(Exception):
    """The checkpoint folder already holds the final checkpoint of this run; `wrote_exports`: this
    start wrote the exports the run had stopped before writing (the run is complete only now)."""

    def __init__(self, message: str, wrote_exports: bool = False):
        super().__init__(message)
        self.wrote_exports = wrote_exports


def check_model_shapes(path: Path, model: torch.nn.Module, flavor: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first parameter that differs."""
    keys = saved_keys(path)
    aliases = aliased_names(model)
    for name, param in model.state_dict().items():
        if name in aliases:  # a tied weight is saved once, under its parameter name
            if f"model.{name}" in keys:
                raise CheckpointError(
                    f"{path}: has a separate {name} (an untied output layer) but this model ({flavor}) ties it to "
                    f"{aliases[name]}; load it into a model with an untied output (e.g. a flavor without tied "
                    "embeddings, or model.flavor = \"hf\" with tie_word_embeddings = false)")
            continue
        saved = keys.get(f"model.{name}")
        if f"model.{name}" not in keys:
            raise CheckpointError(f"{path}: has no parameter {name}; it is not a checkpoint of this model ({flavor})")
        if saved != tuple(param.shape):
            raise CheckpointError(f"{path}: parameter {name} has shape {list(saved)} in the checkpoint but "
                                  f"{list(param.shape)} in this model ({flavor}); it belongs to another model")


def is_resumable(path: Path) -> bool:
    """A checkpoint holding the training state (a full save), not only model weights."""
    full = is_full_checkpoint(path)
    return full if full is not None else "train_state" in saved_items(saved_keys(path))


def checkpoint_record(config, step: int, items: list[str], kind: str, **extra) -> dict:
    """The content of checkpoint.json: what saved this checkpoint, and with which configuration."""
    return {"step": step, "items": items, "kind": kind, **extra, "config": to_dict(config), "code": code_version(),
            "torch": torch.__version__, "saved": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_checkpoint_record(folder: Path, record: dict) -> None:
    write_atomic(folder / CHECKPOINT_RECORD, json.dumps(record, indent=2, default=str) + "\n")


def refuse_overwrite(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists already; refusing to overwrite it (use --checkpoint.overwrite)")


def save_seed_checkpoint(model: torch.nn.Module, folder: Path, overwrite: bool, record: dict | None = None) -> Path:
    """A step-0, model-only checkpoint written by a single process; `record` goes to its
    checkpoint.json (see checkpoint_record)."""
    final = folder / "step-0"
    refuse_overwrite(final, overwrite)
    partial = partial_path(folder, 0)
    shutil.rmtree(partial, ignore_errors=True)
    with warnings.catch_warnings():  # DCP notes that it saves without a process group: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": ModelState(model)}, storage_writer=ChecksumWriter(partial), no_dist=True)
    if record is not None:
        write_checkpoint_record(partial, record)
    if final.exists() or final.is_symlink():
        remove_checkpoint(final)  # a link loses only the link
    partial.rename(final)
    return final
