"""Writing generated scripts without losing a user's edits.

Each script the protocol writes carries a checksum line of its own text. A script whose text no
longer matches its checksum was edited by hand. Writing it again then

- keeps the edited script when the plan would write the same script as the one edited (the edits
  are the user's way of running it on this cluster: a module, a path, an option);
- otherwise leaves it untouched, writes the new script beside it as `<name>.new`, and stops with
  an error naming both: the edits must be carried over by hand, or the edited file removed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from protocol.plan.select import LaunchError

CHECKSUM_LINE = re.compile(r"^# protocol checksum: ([0-9a-f]{16})\b.*\n", re.MULTILINE)
NOTE = "(a script edited by hand is kept: docs/protocol_running.md#scripts-edited-by-hand)"


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_checksum(text: str) -> str:
    """`text` with its checksum as the line after the first (the shebang)."""
    first, _, rest = text.partition("\n")
    return f"{first}\n# protocol checksum: {checksum(text)} {NOTE}\n{rest}"


def generated_from(text: str) -> tuple[str | None, bool]:
    """(the checksum a script was generated with, whether its text still matches it)."""
    found = CHECKSUM_LINE.search(text)
    if found is None:
        return None, False
    body = text[:found.start()] + text[found.end():]
    return found.group(1), checksum(body) == found.group(1)


def write_script(path: Path, text: str) -> str | None:
    """Write the generated `text` to `path` unless a user's edits are there; returns a note for the
    user when an edited script was kept, raises LaunchError when it would have to be replaced."""
    new = with_checksum(text)
    if path.exists():
        old = path.read_text()
        if old == new:
            return None
        made_from, unedited = generated_from(old)
        if not unedited and made_from is not None and made_from == checksum(text):
            return f"{path}: edited by hand, kept (the plan's script is the one it was made from)"
        if not unedited:
            fresh = path.with_name(path.name + ".new")
            fresh.write_text(new)
            fresh.chmod(0o755)
            raise LaunchError(
                f"{path} was edited by hand, and the plan now writes another script: it is left as it is, and the new "
                f"one is {fresh}. Carry your edits over into {fresh.name} and rename it to {path.name}, or delete "
                f"{path.name} to use the new script as written")
    path.write_text(new)
    path.chmod(0o755)
    fresh = path.with_name(path.name + ".new")
    if fresh.exists() and fresh.read_text() == new:  # offered earlier, now in place: not a copy to keep
        fresh.unlink()
    return None
