"""Which code a run ran: the git commit, whether the tree had local changes, and a hash of the
trainer's own source files; and which torch releases that code supports (`require_supported_torch`,
called when the trainer package is first imported, before any torch import).

Torch-free, so the protocol can compute what a run *would* record without starting one. The
source hash is what decides whether two runs ran the same trainer: it covers uncommitted edits
(which a commit id does not) and ignores commits that touch only documentation or tests.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The torch releases the trainer is tested with, as (major, minor): from TORCH_MIN up to, not
# including, TORCH_BELOW. The one place in the code; pyproject.toml's torch requirement says the
# same (tests/unit/test_torch_range.py checks that they agree).
TORCH_MIN = (2, 11)
TORCH_BELOW = (2, 14)
TORCH_RANGE = f">={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"
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


def installed_torch_version() -> str | None:
    """torch.__version__ of the torch this interpreter would import ('2.13.0+cpu', '2.11.0+cu130'),
    or None when there is none, without importing torch (seconds): read from the package's
    torch/version.py, which is what torch.__version__ is. Not from the package's metadata: PyPI's
    CUDA wheels say 2.11.0 there and 2.11.0+cu130 in torch.__version__, which a run records."""
    if "torch" in sys.modules:
        version = getattr(sys.modules["torch"], "__version__", None)
        return str(version) if version else None
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
        if match:
            return match[1]
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_release(version: str) -> tuple[int, int] | None:
    """A torch version's (major, minor): local builds (+cpu, +cu130) and pre-releases count as their
    release (2.14.0a0 is a 2.14); None for what is not a version."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def torch_supported(version: str) -> bool:
    """Whether a torch version lies in the tested range, judged on its release (torch_release)."""
    release = torch_release(version)
    return release is not None and TORCH_MIN <= release < TORCH_BELOW


def torch_problem() -> str | None:
    """Why the installed torch cannot run this trainer, in one line, or None when it can."""
    version = installed_torch_version()
    if version is not None and torch_supported(version):
        return None
    found = f"torch {version} is installed" if version else "torch is not installed"
    releases = ", ".join(f"{TORCH_MIN[0]}.{minor}" for minor in range(TORCH_MIN[1], TORCH_BELOW[1]))
    return (f"{found} ({sys.executable}); this trainer supports torch{TORCH_RANGE} ({releases}): "
            "install one of those, see README.md, Install")


def require_supported_torch() -> None:
    """Exit with one line on stderr (exit code 2, a setup mistake) when the installed torch is not
    one the trainer supports: before an entry point's heavy imports, not as an AttributeError of an
    API the release lacks somewhere in a run."""
    problem = torch_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
