"""A Hugging Face folder's config.json as untrusted input: read only from inside the folder, and
the type and range of every field the shapes are built from checked before they are read
(config_problems, trainer/models/llama3/hf_config.py), so a wrong value is named instead of
failing inside the conversion, or worse, being read as another value (the string "false" is true
to Python). Also where a folder's other files may lie (`inside`).

No torch import: the config validator reads config.json in a light process.
"""

from __future__ import annotations

from pathlib import Path

from trainer.models.llama3.hf_config import QUOTE, HFConfigError, config_problems, read_config_json

NAME_MAX = 255  # bytes in a file name (Linux)


def inside(folder: Path, name, where: str) -> Path:
    """folder / name, when `name` is a plain file name whose file (links followed) stays in the
    folder; else HFConfigError starting with `where`. A Hugging Face cache snapshot
    (models--org--name/snapshots/<revision>/) links each file to its repository's blobs/, which
    is its own."""
    # isprintable: no NUL, line break or other control character, no lone surrogate (no file can have it)
    if not (isinstance(name, str) and name not in ("", ".", "..") and name.isprintable()
            and not any(c in name for c in "/\\") and len(name.encode()) <= NAME_MAX):
        raise HFConfigError(f"{where}: {QUOTE.repr(name)} is not a file name inside the folder {folder}")
    path = folder / name
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: links that lead round in a loop
        raise HFConfigError(f"{where}: {name!r} cannot be followed to a file ({e})") from None
    homes = [folder.resolve()]
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        homes.append((folder.parent.parent / "blobs").resolve())
    if not any(target.is_relative_to(home) for home in homes):
        raise HFConfigError(f"{where}: {name!r} is a link to {target}, outside the folder {folder}")
    return path


def read_checked_config(folder: str | Path, key: str = "model.hf_assets_path") -> dict:
    """The config.json of a Hugging Face folder, every field the shapes are built from checked;
    HFConfigError naming the file and each wrong field otherwise."""
    folder = Path(folder)
    if folder.is_dir():
        inside(folder, "config.json", str(folder))
    config = read_config_json(folder, key)
    problems = config_problems(config)
    if problems:
        raise HFConfigError(f"{folder / 'config.json'}: " + "; ".join(problems))
    return config
