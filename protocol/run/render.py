"""A plan's launches as text: an aligned table, a JSON list, or a runnable bash script.

The shell script runs the single-node launches in order from the repository root and claims each
run folder (`.protocol-run`) first, exactly as `protocol run` does, so `protocol run` and
`protocol compare` recognize the runs it made. Runs needing several nodes are listed, commented
out (use the SLURM scripts for those). A seed checkpoint that exists already is kept, so the
script can run again; whether it is still the plan's is what `protocol run` checks. The points
of a searched sweep are all in the script (it cannot bisect); the table names them, and the plan's
criterion and early-stop rules, below the launches.

Every value in the script is quoted (shlex.quote); a value shown in a comment has its control
characters escaped, so that no value can end a line (the plan's loader refuses them as well:
protocol.plan.text).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

from protocol.plan.model import REPO_ROOT, Launch, Plan, describe_degrees
from protocol.plan.text import escaped
from protocol.run.folders import CLAIM_FUNCTION, claim_command

FORMATS = ("table", "json", "shell")


class FormatError(ValueError):
    """An output format that does not exist."""


def render(plan: Plan, launches: Sequence[Launch], fmt: str) -> str:
    """The launches as an aligned `table`, a `json` list, or a runnable bash script (`shell`)."""
    if fmt == "table":
        return "\n".join([render_table(launches), *plan_notes(plan, launches)])
    if fmt == "json":
        return render_json(launches)
    if fmt == "shell":
        return render_shell(plan, launches)
    raise FormatError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")


def render_table(launches: Sequence[Launch]) -> str:
    header = ("name", "GPUs", "nodes", "degrees", "output")
    rows = [(launch.name, str(launch.nproc), str(launch.nodes), describe_degrees(launch.degrees), str(launch.output))
            for launch in launches]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    for launch, row in zip(launches, rows):
        out += [line(row), f"    {launch.command()}"]
    return "\n".join(out)


def plan_notes(plan: Plan, launches: Sequence[Launch]) -> list[str]:
    """What decides beyond the launches: the criterion, the early-stop rules, the search points."""
    notes = []
    if plan.criterion is not None:
        notes.append(f"criterion: {plan.criterion.describe()} (judges every set: pass = meets it)")
    notes += [f"early stop: {rule.describe()} (test sets only)" for rule in plan.early_stop]
    names = {launch.name for launch in launches}
    for sweep in plan.sweeps:
        points = [name for name in sweep.points if name in names]
        if sweep.search and points:
            notes.append(f"search {sweep.name!r} ({sweep.search}): run on demand by `protocol run`, only the points "
                         f"the bisection needs, in this order (most communication first): {', '.join(points)}")
    return [""] + notes if notes else []


def render_json(launches: Sequence[Launch]) -> str:
    return json.dumps([launch.to_dict() for launch in launches], indent=2)


def render_shell(plan: Plan, launches: Sequence[Launch]) -> str:
    """One node runs the runs in order; runs needing several nodes are listed, commented out."""
    out = ["#!/usr/bin/env bash", "# Convergence protocol launches, in order (the seed checkpoint first).",
           "set -euo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}", "", CLAIM_FUNCTION, ""]
    for i, launch in enumerate(launches, 1):
        head = f"[{i}/{len(launches)}] {launch.name}"
        if launch.nodes > 1:
            out += [comment(f"{head}: needs {launch.nodes} nodes of {launch.procs_per_node}; run this on every node "
                            "with HEAD_NODE set, or use the SLURM scripts (protocol plan --format slurm):"),
                    comment(launch.command()),
                    f"echo {shlex.quote(head + ': skipped here, needs ' + str(launch.nodes) + ' nodes')}", ""]
        else:
            run = [f"echo {shlex.quote(head)}", claim_command(plan, launch), launch.command()]
            if launch.search:  # a script cannot bisect: it runs every point
                out.append(comment(f"{head}: a point of searched sweep {launch.sweep!r}; `protocol run` runs it only "
                                   "when the search needs it"))
            out += [*unless_seed_exists(launch, run, head), ""]
    return "\n".join(out)


def comment(text: str) -> str:
    """A comment line showing `text`, its control characters escaped: a line break in a value must
    not end the comment and make the rest of the value a command."""
    return f"# {escaped(text)}"


def unless_seed_exists(launch: Launch, lines: list[str], head: str) -> list[str]:
    """The seed's lines, skipped when its checkpoint is complete (the trainer never overwrites a
    seed, so running them again would stop the script); other launches' lines as they are."""
    if launch.role != "seed" or launch.seed_checkpoint is None:
        return lines
    metadata = shlex.quote(str(launch.seed_checkpoint / ".metadata"))
    kept = shlex.quote(f"{head}: {launch.seed_checkpoint} exists, kept")
    return [f"if [ -f {metadata} ]; then", f"  echo {kept}", "else", *(f"  {line}" for line in lines), "fi"]
