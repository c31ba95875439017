"""A Hugging Face folder's config.json as untrusted input: the type and range of every field the
shapes are built from (trainer/models/llama3/hf_config.py) are checked before they are read, so a
wrong value is named instead of failing inside the conversion, or worse, being read as another
value (the string "false" is true to Python). Also where a folder's files may lie (`inside`).

No torch import: the config validator reads config.json in a light process.
"""

from __future__ import annotations

import math
from pathlib import Path

from trainer.models.llama3.hf_config import QUOTE, HFConfigError, read_config_json

SIZE_MAX = 2**31 - 1  # a dimension beyond this is not a model this trainer can hold
NAME_MAX = 255  # bytes in a file name (Linux)
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
         "num_key_value_heads", "head_dim")
POSITIVE = ("rms_norm_eps", "rope_theta")
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
NAMES = ("hidden_act", "model_type")
ROPE_TABLES = ("rope_scaling", "rope_parameters")
LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problem(field: str, value, what: str) -> str:
    return f"{field} = {QUOTE.repr(value)} is not {what}"


def _rope_problems(name: str, table) -> list[str]:
    """rope_scaling / rope_parameters: an object or null; Llama 3 scaling needs its factors."""
    if table is None:
        return []
    if not isinstance(table, dict):
        return [_problem(name, table, "an object or null")]
    problems = []
    for key in ("rope_type", "type"):
        if table.get(key) is not None and not isinstance(table[key], str):
            problems.append(_problem(f"{name}.{key}", table[key], "a string"))
    if "rope_theta" in table and not (_number(table["rope_theta"]) and table["rope_theta"] > 0):
        problems.append(_problem(f"{name}.rope_theta", table["rope_theta"], "a finite number > 0"))
    if "llama3" in (table.get("rope_type"), table.get("type")):
        for key in LLAMA3_FACTORS:
            value = table.get(key)
            if not (_number(value) and value > 0):
                problems.append(_problem(f"{name}.{key}", value, "a finite number > 0"))
        original = table.get("original_max_position_embeddings")
        if not (_integer(original) and 1 <= original <= SIZE_MAX):
            problems.append(_problem(f"{name}.original_max_position_embeddings", original, "an integer >= 1"))
    return problems


def config_problems(config: dict) -> list[str]:
    """Each field of a config.json whose value has the wrong type or range (absent or null fields
    are left to hf_config, which says which it needs)."""
    problems = []
    for field in SIZES:
        value = config.get(field)
        if value is not None and not (_integer(value) and 1 <= value <= SIZE_MAX):
            problems.append(_problem(field, value, "an integer >= 1"))
    for field in POSITIVE:
        value = config.get(field)
        if value is not None and not (_number(value) and value > 0):
            problems.append(_problem(field, value, "a finite number > 0"))
    for field in FLAGS:
        value = config.get(field)
        if value is not None and not isinstance(value, bool):
            problems.append(_problem(field, value, "true or false"))
    for field in NAMES:
        value = config.get(field)
        if value is not None and not isinstance(value, str):
            problems.append(_problem(field, value, "a string"))
    dropout = config.get("attention_dropout")
    if dropout is not None and not (_number(dropout) and 0 <= dropout <= 1):
        problems.append(_problem("attention_dropout", dropout, "a number in [0, 1]"))
    for name in ROPE_TABLES:
        problems += _rope_problems(name, config.get(name))
    return problems


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
