"""Trainer options as a command line writes them: a plan's dotted-key overrides become
`--section.key value` options (booleans `--section.key=true|false`, lists comma joined)."""

from __future__ import annotations

from typing import Any


def option_value(value: Any) -> str:
    """A trainer option's value as written on the command line: true/false, lists comma joined."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def override_args(overrides: dict[str, Any]) -> list[str]:
    """Dotted keys to command-line options: --key value, booleans --key=true|false, lists a,b,c."""
    args = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            args.append(f"--{key}={option_value(value)}")
        elif isinstance(value, list):
            text = option_value(value)
            args += [f"--{key}={text}"] if not text else [f"--{key}", text]
        elif isinstance(value, str) and (value.startswith("-") or not value):
            args.append(f"--{key}={value}")  # a value that looks like an option, or nothing
        else:
            args += [f"--{key}", str(value)]
    return args
