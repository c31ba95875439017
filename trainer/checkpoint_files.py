"""One checkpoint folder: its record (checkpoint.json), what it holds, the seed checkpoint, and
the errors of checkpoint handling. (trainer/checkpoint.py decides what a run loads and saves.)"""

from __future__ import annotations

import json
import shutil
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint_items import ModelState, aliased_names
from trainer.checkpoint_layout import CHECKPOINT_RECORD, is_full_checkpoint, partial_path
from trainer.config.manager import to_dict
from trainer.dcp_files import saved_items, saved_keys
from trainer.safe_writes import write_atomic
from trainer.version import code_version


class CheckpointError(ValueError):
    """A checkpoint a user named or pointed at cannot be used; the message names it."""


class CheckpointWriteError(CheckpointError):
    """A save could not be written (no space left, a quota, a file-size limit). Not a user's
    configuration mistake, but a restart would fail the same way until someone frees space: it
    stops the run like one (exit 2, no automatic restart)."""


def save_error_text(error: BaseException) -> str:
    """The OS error under DCP's CheckpointException (one per failed rank), as a short text."""
    if isinstance(error, CheckpointException):
        failures = {rank: failure[0] if isinstance(failure, tuple) else failure
                    for rank, failure in error.failures.items()}
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    return f"{type(error).__name__}: {error}"


class TrainingComplete(Exception):
    """The checkpoint folder already holds the final checkpoint of this run."""


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
        dcp.save({"model": ModelState(model)}, checkpoint_id=str(partial), no_dist=True)
    if record is not None:
        write_checkpoint_record(partial, record)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return final
