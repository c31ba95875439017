"""Where checkpoints live on disk, and the checks of load options that need only the file system.

Kept free of torch so the launcher's preflight can refuse a bad checkpoint option in a second,
before any process starts. (trainer/checkpoint.py does the loading and saving.)
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_FOLDER = re.compile(r"^step-(\d+)$")


def checkpoint_folder(config) -> Path:
    return Path(config.job.dump_folder) / config.checkpoint.folder


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


def named_step(folder: Path, found: dict[int, Path], step: int) -> Path:
    """The checkpoint of checkpoint.load_step, or ValueError saying why there is none."""
    if step in found:
        return found[step]
    if partial_path(folder, step).exists():
        raise ValueError(f"checkpoint.load_step={step}: the save of step {step} in {folder} never "
                         "completed (the run stopped while writing it)")
    available = ", ".join(str(s) for s in found) or "none"
    raise ValueError(f"checkpoint.load_step={step}: no checkpoint of step {step} in {folder}; "
                     f"complete checkpoints: {available}")


def check_initial_load_path(path: Path, in_hf: bool) -> None:
    if not path.exists():
        raise ValueError(f"checkpoint.initial_load_path: {path} does not exist")
    if in_hf and not (path / "config.json").is_file():
        raise ValueError(f"checkpoint.initial_load_path: {path} has no config.json; expected a Hugging Face model folder")
    if not in_hf and not (path / ".metadata").is_file():
        raise ValueError(f"checkpoint.initial_load_path: {path} is not a complete DCP checkpoint (no .metadata file)")


def check_load_options(config) -> None:
    """Raise ValueError when the configured checkpoint to load cannot exist."""
    c = config.checkpoint
    folder = checkpoint_folder(config)
    found = complete_checkpoints(folder) if c.enable else {}
    if c.enable and c.load_step != -1:
        named_step(folder, found, c.load_step)
    elif not found and c.initial_load_path:
        check_initial_load_path(Path(c.initial_load_path), c.initial_load_in_hf)
