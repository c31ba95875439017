"""Which training trajectory a checkpoint belongs to, and which model its weights compute.

A *lineage* is one trajectory of training: a run from its first start through every resume.
Each checkpoint.json records it (`lineage`, a short random id) with the checkpoint's `parent`:
the checkpoint its training continued from (the save before it in the run, or what the run
loaded when it started), so the chain of any checkpoint can be followed back to its start.

The checkpoint folder's lineage.json names the lineage of the folder's newest checkpoints and its
ancestors: the lineages it forked from, each up to the step of the fork. A rewind
(checkpoint.load_step S with checkpoint.overwrite, while newer checkpoints exist) starts a new
lineage from step S and moves the newer checkpoints, which belong to the abandoned trajectory, to
<folder>/previous/<time>-after-step-S/; the records of their steps leave metrics.jsonl the same
way (trainer/records/run_meta.py). A resume then refuses a checkpoint of the folder that is not on the
current trajectory (one copied back, or written by a job that should not have been writing there)
by name instead of splicing two trajectories into one curve; the checkpoints up to a fork remain
on it.

Reduced tensor-parallel synchronization (parallelism.tensor_parallel_sync per_block / grouped)
changes the function the weights compute: what was trained depends on the variant, the group size
and the TP degree. `model_change` says when a checkpoint was trained as another model than this
run builds. Torch-free: the launcher's preflight may use it.
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime
from pathlib import Path

from trainer.checkpoint.on_disk import read_checkpoint_record
from trainer.records.untrusted_json import check_lineage_head, read_object
from trainer.records.safe_writes import write_atomic

LINEAGE_FILE = "lineage.json"
PREVIOUS_DIR = "previous"


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def read_head(folder: Path) -> dict | None:
    """The folder's lineage.json: {"lineage", "step", "ancestors": [{"lineage", "until_step"}]}
    of its newest save, or None; RecordError when it is not what this trainer writes."""
    file = Path(folder) / LINEAGE_FILE
    head = read_object(file)
    return None if head is None else check_lineage_head(file, head)


def write_head(folder: Path, lineage: str, step: int, ancestors: list[dict]) -> None:
    """Atomically: a reader never sees half a file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / LINEAGE_FILE, json.dumps({"lineage": lineage, "step": step, "ancestors": ancestors}) + "\n")


def lineage_of(path: Path) -> str | None:
    record = read_checkpoint_record(path)
    return record.get("lineage") if record else None


def on_trajectory(head: dict, path: Path) -> bool:
    """Whether checkpoint `path` is on the trajectory of `head`: of its lineage, or of an
    ancestor's up to the step where the head's lineage forked from it. Checkpoints of earlier
    versions record no lineage: nothing to compare."""
    record = read_checkpoint_record(path) or {}
    theirs, step = record.get("lineage"), record.get("step", 0)
    if theirs is None or theirs == head["lineage"]:
        return True
    return any(a.get("lineage") == theirs and step <= a.get("until_step", -1) for a in head.get("ancestors", []))


def forked_ancestors(head: dict | None, path: Path, step: int) -> list[dict]:
    """The ancestors of a new lineage forked at `step` from checkpoint `path` of a folder whose
    head is `head`: the head's trajectory up to `step`, and the checkpoint's own lineage."""
    ancestors = []
    if head is not None:
        ancestors = [{"lineage": a["lineage"], "until_step": min(a["until_step"], step)}
                     for a in head.get("ancestors", [])]
        ancestors.append({"lineage": head["lineage"], "until_step": step})
    theirs = lineage_of(path)
    if theirs is not None and all(a["lineage"] != theirs for a in ancestors):
        ancestors.append({"lineage": theirs, "until_step": step})
    return ancestors


def foreign_checkpoint(folder: Path, path: Path) -> str | None:
    """Why the checkpoint `path` of `folder` must not be resumed (it is not on the trajectory of
    the folder's newest saves), or None."""
    head, theirs = read_head(folder), lineage_of(path)
    if head is None or on_trajectory(head, path):
        return None
    return (f"{path} belongs to another training trajectory (lineage {theirs}) than this folder's run (lineage "
            f"{head['lineage']}, last saved at step {head['step']}): resuming it would splice two runs into one "
            f"curve. It was copied back, or written by another job: move it out of {folder}, or continue its own "
            f"trajectory in another folder with --checkpoint.initial_load_path {path} "
            "--checkpoint.initial_load_model_only=false --job.dump_folder NEW_FOLDER")


def move_newer_aside(folder: Path, found: dict[int, Path], step: int) -> Path | None:
    """Move the checkpoints after `step` to <folder>/previous/<time>-after-step-<step>/ (nothing
    is deleted); returns that folder, or None when there were none."""
    newer = [path for s, path in found.items() if s > step]
    if not newer:
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = Path(folder) / PREVIOUS_DIR / f"{stamp}-after-step-{step}"
    n = 1
    while target.exists():
        target = target.with_name(f"{stamp}-after-step-{step}.{n}")
        n += 1
    target.mkdir(parents=True)
    for path in newer:
        os.replace(path, target / path.name)
    return target


def model_variant(parallelism: dict) -> dict | None:
    """What a [parallelism] section (as saved in checkpoint.json) changes about the function the
    weights compute: None for exact tensor parallelism (any degree computes the same model)."""
    sync = parallelism.get("tensor_parallel_sync", "full")
    if sync == "full":
        return None
    return {"tensor_parallel_sync": sync, "tensor_parallel_degree": parallelism.get("tensor_parallel_degree", 1),
            "tensor_parallel_sync_group": parallelism.get("tensor_parallel_sync_group", 0) if sync == "grouped" else 1}


def describe_variant(variant: dict | None) -> str:
    if variant is None:
        return "the exact model (tensor_parallel_sync = \"full\")"
    sync = variant["tensor_parallel_sync"]
    group = f", {variant['tensor_parallel_sync_group']} blocks per sync" if sync == "grouped" else ""
    return f"tensor_parallel_sync = \"{sync}\"{group} at tensor_parallel_degree {variant['tensor_parallel_degree']}"


def model_change(path: Path, parallelism: dict, target: str = "this run builds") -> str | None:
    """Why the trained weights of checkpoint `path` compute another function in a run with this
    [parallelism] section, or None. A seed checkpoint (step 0, never trained) fits every variant."""
    record = read_checkpoint_record(path)
    if record is None or record.get("kind") == "seed" or record.get("step") == 0:
        return None
    saved = model_variant(record.get("config", {}).get("parallelism", {}))
    now = model_variant(parallelism)
    if saved == now:
        return None
    return (f"{path} was trained as {describe_variant(saved)}; {target} {describe_variant(now)}, in which "
            "the same weights compute another function (the loss jumps at the first step). Set "
            "--checkpoint.accept_model_change if that is intended (e.g. to fine-tune the weights in the other "
            "variant)")
