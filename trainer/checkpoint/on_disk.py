"""Where checkpoints live on disk, and the checks of load options that need only the file system.

Kept free of torch so the launcher's preflight can refuse a bad checkpoint option in a second,
before any process starts. (trainer/checkpoint/manager.py does the loading and saving.)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from trainer.records.untrusted_json import check_checkpoint_record, read_object

STEP_FOLDER = re.compile(r"^step-(\d+)$")
PARTIAL_FOLDER = re.compile(r"^\.step-(\d+)\.partial$")
CHECKPOINT_RECORD = "checkpoint.json"  # beside DCP's .metadata: what saved the checkpoint (see read_checkpoint_record)
MODEL_ONLY_DIR = "model_only"  # inside the last step-N with checkpoint.last_save_model_only: the weights alone
HF_EXPORT_DIR = "hf"  # inside the last step-N with checkpoint.last_save_in_hf: the Hugging Face export


def checkpoint_folder(config) -> Path:
    return Path(config.job.dump_folder) / config.checkpoint.folder


def remove_checkpoint(path: Path) -> None:
    """Remove a step folder of the checkpoint folder; one that is a link (to a checkpoint kept
    elsewhere, linked in to resume it) loses the link only, never what it points to. A folder is
    renamed out of sight first (`removing_path`): emptied in place, it would be seen for a moment
    as a step-N without .metadata, a checkpoint copied in part, by whatever reads the folder then
    (another job's checks refused a live job's folder for it instead of naming the job)."""
    if path.is_symlink():
        path.unlink()
        return
    doomed = removing_path(path)
    discard(doomed)  # left by a removal that was interrupted (or put there by hand)
    path.rename(doomed)
    shutil.rmtree(doomed)


def removing_path(path: Path) -> Path:
    """Where a step folder goes while it is removed (a hidden name no reader takes for a step)."""
    return path.with_name(f".{path.name}.removing")


def discard(path: Path) -> None:
    """Remove what is at `path`, if anything: a link or a file is unlinked (what a link points to
    is never touched), a folder removed with its contents."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def partial_path(folder: Path, step: int) -> Path:
    return folder / f".step-{step}.partial"


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> path of every complete DCP checkpoint in folder, oldest first."""
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = STEP_FOLDER.match(path.name)
        if match and (path / ".metadata").is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def finished_partials(folder: Path) -> dict[int, Path]:
    """step -> .step-N.partial folders holding DCP's .metadata, oldest first. DCP writes .metadata
    last, once every rank's data is written, so such a save finished but was not renamed yet (the
    run stopped first); a run that writes checkpoints publishes it at start (see
    CheckpointManager.resume, which also checks that .metadata is readable)."""
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = PARTIAL_FOLDER.match(path.name)
        if match and (path / ".metadata").is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def incomplete_step_folders(folder: Path) -> list[Path]:
    """step-N folders without DCP metadata: not written by a complete save (or copied in part).
    A save never publishes one, so one found here is a user's folder that must not be ignored:
    the run would start without it and later refuse to write its step. A step folder that a live
    job's retention moves away between the listing and the look inside is not one: it is gone
    when looked for again (a removal renames the whole folder at once, `remove_checkpoint`)."""
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir()
                  if STEP_FOLDER.match(path.name) and not (path / ".metadata").is_file() and os.path.lexists(path))


def check_step_folders(folder: Path) -> None:
    """ValueError naming the step-N folders that look like checkpoints but are not complete."""
    broken = incomplete_step_folders(folder)
    if broken:
        names = ", ".join(str(path) for path in broken)
        raise ValueError(f"checkpoint folder {folder}: {names} has no .metadata, so it is not a complete DCP "
                         "checkpoint (copied in part, or not written by this trainer); move it out of the "
                         "checkpoint folder, or restore it completely")


def named_step(folder: Path, found: dict[int, Path], step: int) -> Path:
    """The checkpoint of checkpoint.load_step, or ValueError saying why there is none."""
    if step in found:
        return found[step]
    if (partial_path(folder, step) / ".metadata").is_file():
        raise ValueError(f"checkpoint.load_step={step}: the save of step {step} in {folder} finished but was never "
                         "published; a run without checkpoint.load_only publishes it when it starts")
    if partial_path(folder, step).exists():
        raise ValueError(f"checkpoint.load_step={step}: the save of step {step} in {folder} never "
                         "completed (the run stopped while writing it)")
    available = ", ".join(str(s) for s in found) or "none"
    raise ValueError(f"checkpoint.load_step={step}: no checkpoint of step {step} in {folder}; "
                     f"complete checkpoints: {available}")


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def initial_load_folder(path: Path, in_hf: bool, model_only: bool = True) -> Path:
    """The folder checkpoint.initial_load_path reads, or ValueError naming the path and what
    would be valid.

    Without initial_load_in_hf: a DCP checkpoint (.metadata). With it: a Hugging Face folder
    (config.json + safetensors), or a step-N checkpoint folder whose HF_EXPORT_DIR holds the
    export of checkpoint.last_save_in_hf; a run can thus start from what another run saved,
    in either format, by naming the same step-N."""
    key = "checkpoint.initial_load_path"
    if not path.exists():
        raise ValueError(f"{key}: {path} does not exist")
    export = path / HF_EXPORT_DIR
    if in_hf:
        if not model_only:  # a Hugging Face folder has no optimizer, schedule or data position to load
            raise ValueError(f"checkpoint.initial_load_model_only = false: {key} {path} is read as Hugging Face "
                             "weights (checkpoint.initial_load_in_hf), which hold the model only; set "
                             "initial_load_model_only = true, or load a DCP checkpoint without initial_load_in_hf")
        if _is_hf_folder(path):
            return path
        if _is_hf_folder(export):
            return export
        dcp_note = (f"; {path} is a DCP checkpoint, which loads without --checkpoint.initial_load_in_hf"
                    if (path / ".metadata").is_file() else "")
        raise ValueError(f"{key}: {path} has no config.json, nor {HF_EXPORT_DIR}/config.json; with "
                         "checkpoint.initial_load_in_hf it must be a Hugging Face model folder (config.json + "
                         f"*.safetensors) or a step-N checkpoint folder saved with checkpoint.last_save_in_hf (the "
                         f"export is in its {HF_EXPORT_DIR}/){dcp_note}")
    if (path / ".metadata").is_file():
        return path
    hf = next((folder for folder in (path, export) if _is_hf_folder(folder)), None)
    hint = f"; {hf} holds Hugging Face weights, which load with --checkpoint.initial_load_in_hf" if hf else ""
    raise ValueError(f"{key}: {path} is not a complete DCP checkpoint (no .metadata file); expected a DCP "
                     f"checkpoint folder (a step-N, or a seed checkpoint){hint}")


def check_load_options(config) -> None:
    """Raise ValueError when the configured checkpoint to load cannot exist."""
    c = config.checkpoint
    folder = checkpoint_folder(config)
    if c.enable:
        check_step_folders(folder)
    found = complete_checkpoints(folder) if c.enable else {}
    if c.enable and not c.load_only:  # published when the run starts
        found = dict(sorted({**finished_partials(folder), **found}.items()))
    if c.enable and c.load_step != -1:
        named_step(folder, found, c.load_step)
    elif not found and c.initial_load_path:
        initial_load_folder(Path(c.initial_load_path), c.initial_load_in_hf, c.initial_load_model_only)


def fingerprint(path: Path) -> str | None:
    """A short identity of a checkpoint's content, cheap to compute whatever its size.

    DCP checkpoint: sha256 of its .metadata (which lists every tensor, shard, file and offset, and
    a save id that differs between two saves). Hugging Face folder: sha256 of config.json and the
    names and sizes of its safetensors files. None when the path holds neither.
    """
    path = Path(path)
    digest = hashlib.sha256()
    if (path / ".metadata").is_file():
        digest.update((path / ".metadata").read_bytes())
    elif (path / "config.json").is_file():
        digest.update((path / "config.json").read_bytes())
        for file in sorted(path.glob("*.safetensors")):
            digest.update(f"{file.name}:{file.stat().st_size}".encode())
    else:
        return None
    return digest.hexdigest()[:16]


def read_checkpoint_record(path: Path) -> dict | None:
    """The checkpoint.json written beside a checkpoint's .metadata: {"step", "items", "kind"
    ("seed", "periodic" or "final"), "exports", "config", "code", "torch", "saved", "lineage",
    "parent"}; None when absent (checkpoints of older versions have none). RecordError, naming
    the file and the field, when it is not what this trainer writes (trainer/records/untrusted_json.py)."""
    file = Path(path) / CHECKPOINT_RECORD
    record = read_object(file)
    return None if record is None else check_checkpoint_record(file, record)


def missing_exports(path: Path, config) -> list[str]:
    """The exports the configuration asks of the last save that the final checkpoint `path` lacks
    (the run stopped while writing them; they were removed at restart): a run that finds itself
    complete writes them before it ends."""
    record = read_checkpoint_record(path)
    if record is None or record.get("kind") != "final":
        return []
    wanted = [name for name, on in ((MODEL_ONLY_DIR, config.checkpoint.last_save_model_only),
                                    (HF_EXPORT_DIR, config.checkpoint.last_save_in_hf)) if on]
    return [name for name in wanted if name not in record.get("exports", [])]


def is_full_checkpoint(path: Path) -> bool | None:
    """Whether a checkpoint holds the training state, from the items its checkpoint.json lists;
    None when it has no such record (checkpoints of earlier versions: only their DCP metadata,
    read with torch, tells)."""
    record = read_checkpoint_record(path)
    if record is None or "items" not in record:
        return None
    return "train_state" in record["items"]


def past_steps_message(path: Path, newest: int, total: int) -> str:
    """The refusal of a full checkpoint past training.steps (the preflight's and the ranks')."""
    return (f"{path} is past training.steps = {total}: this run went further already. Raise "
            f"training.steps above {newest} to continue it, resume an earlier step with "
            "--checkpoint.load_step S --checkpoint.overwrite, or use another job.dump_folder")


def complete_message(path: Path, total: int, note: str = "") -> str:
    """What a run whose final checkpoint is `path` says before it ends successfully."""
    return (f"{path} is the final checkpoint of this run (training.steps = {total}); nothing to do{note}. Raise "
            "training.steps to continue.")
