"""Which code a run ran: the git commit, whether the tree had local changes, and a hash of the
trainer's own source files.

Torch-free, so the protocol can compute what a run *would* record without starting one. The
source hash is what decides whether two runs ran the same trainer: it covers uncommitted edits
(which a commit id does not) and ignores commits that touch only documentation or tests.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# What a training process executes: the trainer package and the launcher script.
SOURCE_GLOBS = ("trainer/**/*.py", "torchrun_launch.sh")


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """{"commit": sha or None, "dirty": bool or None, "source_sha256": hex digest}.

    commit and dirty are None outside a git checkout (e.g. an installed copy without .git).
    dirty counts changes to tracked files, and untracked files among the trainer's sources (a
    user's data or scripts beside the checkout are not a change of the code).
    """
    return {**git_state(REPO_ROOT), "source_sha256": source_hash(REPO_ROOT)}


def source_hash(root: Path) -> str:
    """sha256 over the relative path and bytes of every trainer source file, in sorted order."""
    digest = hashlib.sha256()
    files = sorted({path for pattern in SOURCE_GLOBS for path in root.glob(pattern) if path.is_file()})
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_state(root: Path) -> dict:
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(root, "status", "--porcelain")
    if status is None:
        return {"commit": commit, "dirty": None}
    return {"commit": commit, "dirty": any(changes_code(line) for line in status.splitlines())}


def changes_code(status_line: str) -> bool:
    """A line of `git status --porcelain`: any change to a tracked file, or an untracked file (or
    folder) that is or holds trainer source."""
    if not status_line.startswith("??"):
        return True
    path = status_line[3:].strip().strip('"')
    return path.startswith("trainer/") or path == "torchrun_launch.sh"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def describe(version: dict) -> str:
    """'3f2a1c9d (with local changes)' for messages and reports."""
    commit = version.get("commit")
    if not commit:
        return f"source {version.get('source_sha256', '?')[:12]} (not a git checkout)"
    return commit[:8] + (" (with local changes)" if version.get("dirty") else "")
