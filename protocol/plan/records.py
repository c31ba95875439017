"""A run's own record (`<dump_folder>/run_meta.json`, trainer.records.run_meta), read, and two
configurations compared option by option.

What a run ran is told from this record, never from the plan's current text: `protocol run`
compares it with what the plan would run now (protocol.run.reuse), and the report describes each
run from it (protocol.verdict.run_info).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol.plan.options import option_value

MAX_SHOWN = 8  # differences listed per run before "and N more"


def read_record(folder: Path) -> dict | None:
    from trainer.records.run_meta import read_record as read

    return read(folder)


def normalized(value: Any) -> Any:
    """As it reads back from a JSON record: tuples become lists, paths and other objects strings."""
    return json.loads(json.dumps(value, default=str))


def flat(config: dict | None, prefix: str = "") -> dict[str, Any]:
    """{"optimizer": {"lr": 0.003}} -> {"optimizer.lr": 0.003}."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def show(value: Any) -> str:
    """An option's value in a message: as on the command line; 'unset' for an absent one."""
    if value is None:
        return "unset"
    if value == "":
        return "''"
    return option_value(value)


def config_changes(old: dict | None, new: dict | None, skip: set[str] = frozenset()) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every option that differs, in the order of the config."""
    a, b = flat(normalized(old)), flat(normalized(new))
    keys = list(dict.fromkeys([*b, *a]))
    return [(key, a.get(key), b.get(key)) for key in keys if key not in skip and a.get(key) != b.get(key)]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> list[str]:
    """'optimizer.lr 0.006 -> 0.003' for each change, at most MAX_SHOWN of them."""
    lines = [f"{key} {show(old)} -> {show(new)}" for key, old, new in changes[:MAX_SHOWN]]
    if len(changes) > MAX_SHOWN:
        lines.append(f"and {len(changes) - MAX_SHOWN} more options")
    return lines
