"""What text a plan may hold, since its values end up in scripts.

Every string of a plan (names, paths, trainer options and their values, [slurm] keys) becomes part
of a generated bash script, a command line or an #SBATCH line. The scripts quote every value, but
a line break cannot be quoted where a line is read by something other than bash (a comment, an
#SBATCH line), and a run name is also a folder name and a job name. So no string of a plan, key or
value, may hold a control character (C0, DEL, C1, and the Unicode line and paragraph separators);
only a prologue line may hold a tab (it is shell, where a tab is a space).

#SBATCH lines are read by sbatch, which splits them at whitespace and reads quotes, backslashes
and `#` itself (src/sbatch/opt.c, _get_argument): a value going there may hold none of them.
"""

from __future__ import annotations

import json
import re
from typing import Any

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SBATCH_SPECIAL = re.compile(r"""[\s'"\\#]""")
NAMES = {"\n": "newline", "\r": "carriage return", "\t": "tab", "\x00": "NUL"}
PROLOGUE = re.compile(r"slurm(\.seed|\.train)?\.prologue\[\d+\]")  # a prologue line: a tab is allowed there
PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
SBATCH_RULE = "sbatch splits #SBATCH lines at whitespace and reads quotes, backslashes and # itself"


def describe(char: str) -> str:
    """'newline', 'tab', ... or the code point: U+001B."""
    return NAMES.get(char, f"U+{ord(char):04X}")


def short(text: Any, limit: int = 200) -> str:
    """The text as Python writes it (every control character escaped), cut after `limit` characters;
    any other value as Python writes it, cut there too (a plan's array may hold thousands of items)."""
    if isinstance(text, str):
        return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
    if isinstance(text, int) and abs(text) > 10**limit:  # Python writes no int of more than 4300 digits
        return f"an integer of {text.bit_length()} bits"
    written = repr(text)
    return written if len(written) <= limit else written[:limit] + "..."


def escaped(text: str) -> str:
    """`text` with each control character written as its escape (\\n, \\x1b), for a comment line."""
    return CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


def key_path(path: str, key: str) -> str:
    """Where a key is, as messages name it: plan.name, plan.overrides."optimizer.lr"."""
    part = key if PLAIN_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)
    return f"{path}.{part}" if path else part


def without_control_characters(data: dict) -> tuple[dict, list[str]]:
    """The parsed plan with every control character removed, and one problem per string (key or
    value) that held one, naming where it is. The rest of the checks then read what the user most
    likely meant, so that fixing these problems reveals no new ones."""
    problems: list[str] = []
    return _clean(data, "", problems), problems


def _clean(value: Any, path: str, problems: list[str]) -> Any:
    if isinstance(value, str):
        found = CONTROL.search(value.replace("\t", "") if PROLOGUE.fullmatch(path) else value)
        if found is None:
            return value
        who = "names" if path.endswith(".name") else "plan values"
        problems.append(f"{path}: {short(value)} contains a control character ({describe(found.group())}); "
                        f"{who} may not")
        return CONTROL.sub("", value)
    if isinstance(value, list):
        return [_clean(item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
    if isinstance(value, dict):
        cleaned = {}
        for key, item in value.items():
            found = CONTROL.search(key)
            if found is not None:
                problems.append(f"{path or 'the plan'}: the key {short(key)} contains a control character "
                                f"({describe(found.group())}); keys may not")
                key = CONTROL.sub("", key)
            cleaned[key] = _clean(item, key_path(path, key), problems)
        return cleaned
    return value


def sbatch_special(value: str) -> str | None:
    """The first character of `value` at which sbatch would split or cut an #SBATCH line, described
    ('a space', "'#'"); None when it has none."""
    found = SBATCH_SPECIAL.search(value)
    if found is None:
        return None
    char = found.group()
    return "a space" if char == " " else describe(char) if char.isspace() else repr(char)
