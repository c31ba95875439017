"""Run folders: which ones the protocol owns, the stop marker it writes, and moving a stale run aside.

Every run folder the protocol starts a run in holds `.protocol-run`, one JSON line naming the plan
and the run ({"plan", "run", "command", "created"}), written before the run starts, by
`protocol run` and by the generated shell and sbatch scripts alike. A folder at a run's path
without it, and not empty, belongs to someone else: the protocol never writes there. Whether a
run finished, and what it ran, comes from the run's own record (protocol.run.reuse), never from the
marker. A run an early-stop rule ended gets `.protocol-stopped` (protocol.plan.early_stop reads
it back); a run started again loses it.

A stale run is moved, never deleted, to `<plan.output>/superseded/<slug>-<time>/` (no run can be
named so: protocol.plan.model.RESERVED_SLUGS).
"""

from __future__ import annotations

import json
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path

from protocol.plan.early_stop import STOP_MARKER, Breach, marker_text as stop_text
from protocol.plan.model import RUN_MARKER, SUPERSEDED_DIR, Launch, Plan


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def identity(plan: Plan, launch: Launch) -> dict:
    return {"plan": plan.name, "run": launch.name}


def marker_text(plan: Plan, launch: Launch, created: str) -> str:
    return json.dumps({**identity(plan, launch), "command": launch.command(), "created": created}) + "\n"


def foreign_folder(plan: Plan, launch: Launch) -> str | None:
    """Why the protocol must not write into this run's folder, or None when it may."""
    folder = launch.output
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{folder} exists and is not a folder"
    marker = folder / RUN_MARKER
    if not marker.is_file():
        if any(folder.iterdir()):
            return (f"{folder} exists and was not made by the protocol (no {RUN_MARKER}); move it away or "
                    "change plan.output")
        return None
    try:
        owner = json.loads(marker.read_text())
    except (OSError, ValueError):
        return f"{marker} cannot be read; move {folder} away or change plan.output"
    if not isinstance(owner, dict) or {k: owner.get(k) for k in ("plan", "run")} != identity(plan, launch):
        owner = owner if isinstance(owner, dict) else {}
        return (f"{folder} belongs to run {owner.get('run')!r} of plan {owner.get('plan')!r}; give this plan "
                "another plan.output")
    return None


def claim_folder(plan: Plan, launch: Launch) -> None:
    """Create the run's folder and write its marker (the latest command that started it)."""
    launch.output.mkdir(parents=True, exist_ok=True)
    (launch.output / RUN_MARKER).write_text(marker_text(plan, launch, now()))


def mark_stopped(folder: Path, found: Breach) -> None:
    (Path(folder) / STOP_MARKER).write_text(stop_text(found, now()))


def clear_stopped(folder: Path) -> None:
    """A run started again is no longer stopped."""
    (Path(folder) / STOP_MARKER).unlink(missing_ok=True)


def supersede(plan: Plan, launch: Launch) -> Path:
    """Move a run's folder to <output>/superseded/<slug>-<time>[-N]/; returns where it went."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = plan.output / SUPERSEDED_DIR / f"{launch.slug}-{stamp}"
    counter = 0
    while target.exists():
        counter += 1
        target = plan.output / SUPERSEDED_DIR / f"{launch.slug}-{stamp}-{counter}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(launch.output, target)
    return target


# ---------------------------------------------------------------------------------------------
# The same claim in the generated scripts

CLAIM_FUNCTION = r'''# claim FOLDER PLAN RUN MARKER_START: refuse a folder of another run or of someone else, then
# write .protocol-run (MARKER_START is the marker's JSON up to its "created" time).
claim() {
  local folder=$1 marker=$1/.protocol-run
  if [ -e "$folder" ] && [ ! -d "$folder" ]; then
    echo "error: $folder exists and is not a folder" >&2; exit 2
  elif [ -f "$marker" ]; then
    if ! grep -qF "\"plan\": $2" "$marker" || ! grep -qF "\"run\": $3" "$marker"; then
      echo "error: $folder belongs to another plan or run (see $marker); give this plan another plan.output" >&2
      exit 2
    fi
  elif [ -d "$folder" ] && [ -n "$(ls -A "$folder")" ]; then
    echo "error: $folder exists and was not made by the protocol (no .protocol-run); move it away or change plan.output" >&2
    exit 2
  fi
  mkdir -p "$folder"
  printf '%s"created": "%s"}\n' "$4" "$(date -u +%Y-%m-%dT%H:%M:%S+00:00)" > "$marker"
}'''


def claim_command(plan: Plan, launch: Launch) -> str:
    """The shell line that claims this run's folder with CLAIM_FUNCTION; the marker it writes
    equals claim_folder's."""
    start = marker_text(plan, launch, "")[: -len('"created": ""}\n')]
    return " ".join(["claim", shlex.quote(str(launch.output)), shlex.quote(json.dumps(plan.name)),
                     shlex.quote(json.dumps(launch.name)), shlex.quote(start)])
