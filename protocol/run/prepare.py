"""What happens to each selected launch, decided once, before any of them starts.

Runs are resumable by design: long plans get interrupted, and a finished run costs GPU hours.
Every training run saves checkpoints into its own folder (protocol.plan.model.save_args), and one
that is run again after an interruption resumes from its newest one. So before anything starts,
`prepare` decides for every selected launch, in this order:

1. refuse: a folder at a run's path that the protocol did not create is never written to; every
   such folder is named in one error, and nothing runs;
2. reuse, run or stale, from each run's own record (protocol.run.reuse): a current finished run
   is reused, an unfinished or missing one is run (resuming from its newest checkpoint), one that
   an early-stop rule still in the plan ended stays stopped;
3. stale runs are refused with one message naming every difference and the flag that reruns
   them (`--rerun-stale`); with the flag their folders move to `<output>/superseded/` and they
   run afresh.

The launchers (protocol.run.local, protocol.run.slurm) then only carry the decisions out: a
launch to reuse or left stopped is reported as such (`settled`), a launch to run claims its
folder and starts, with the step it resumes from known already. Only what cannot be known before
(a run whose seed checkpoint failed is skipped) is decided while running.

Every run starts in the repository root (where torchrun_launch.sh is); the plan's config and
output paths are absolute, so the working directory only matters for relative paths a user
wrote into overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from protocol.plan.model import SUPERSEDED_DIR, Launch, Plan
from protocol.plan.select import LaunchError
from protocol.run.folders import foreign_folder, supersede
from protocol.run.outcome import Progress, RunResult
from protocol.run.reuse import REUSE, RUN, STALE, STOPPED, Decision, assess, resume_step

RERUN_FLAG = "--rerun-stale"


def prepare(plan: Plan, selected: Sequence[Launch], rerun_stale: bool, report: Progress) -> dict[str, Decision]:
    """Decide for every selected launch before anything runs; returns name -> Decision: reuse,
    run (with the step it resumes from) or stopped.

    Raises LaunchError naming every foreign folder, or (without rerun_stale) every stale run.
    With rerun_stale, stale runs are moved aside and run afresh.
    """
    foreign = [why for launch in selected if (why := foreign_folder(plan, launch))]
    if foreign:
        raise LaunchError("refusing to write into folders the protocol did not create:\n  " + "\n  ".join(foreign))
    decisions = assess(plan, list(selected))
    stale = [d for d in decisions.values() if d.action == STALE]
    if stale and not rerun_stale:
        raise LaunchError(stale_message(plan, stale, selected))
    for decision in stale:
        where = supersede(plan, decision.launch)
        report(f"{decision.launch.name}: stale ({'; '.join(decision.differences)}); moved to {where}")
        decisions[decision.launch.name] = Decision(decision.launch, RUN, reason="rerun of a stale run")
    return {name: dataclasses.replace(d, resume_from=resume_step(plan, d.launch)) if d.action == RUN else d
            for name, d in decisions.items()}


def settled(decision: Decision, head: str, report: Progress, log: Path | None = None) -> RunResult | None:
    """The result of a launch that needs no run, reported under `head`: reused, or stopped earlier
    by a rule still in the plan; None for a launch to run."""
    name = decision.launch.name
    if decision.action == REUSE:
        report(f"{head}: already complete, skipped")
        return RunResult(name, "already complete", log=log)
    if decision.action == STOPPED:
        report(f"{head}: stopped earlier by {decision.reason}, skipped")
        return RunResult(name, "stopped", log=log, message=decision.reason)
    return None


def resume_note(plan: Plan, decision: Decision) -> str:
    """', resuming from step S (<its checkpoint folder>)' for a run that stopped before the end
    and saved a checkpoint (it continues its curve from there), else ''."""
    if decision.resume_from is None:
        return ""
    return f", resuming from step {decision.resume_from} ({decision.launch.output / plan.checkpoint_folder})"


def stale_message(plan: Plan, stale: Sequence[Decision], selected: Sequence[Launch]) -> str:
    """One message: each difference once, with the runs it concerns, and how to rerun them."""
    lines = [f"{who}: {text}" for text, who in grouped_differences(stale, selected)]
    several = len(stale) > 1
    it, its, they = ("them", "their", "they") if several else ("it", "its", "it")
    return (f"{len(stale)} run{'s' if several else ''} in {plan.output} {'were' if several else 'was'} made with "
            f"something other than what {plan.path} runs now, so {its} results would not describe the plan:\n  "
            + "\n  ".join(lines) + f"\nRun {it} again by adding {RERUN_FLAG} to the same `protocol run` command "
            f"({its} folder{'s' if several else ''} move{'' if several else 's'} to {plan.output / SUPERSEDED_DIR}/, "
            f"nothing is deleted), or restore what {they} {'were' if several else 'was'} made with.")


def grouped_differences(stale: Sequence[Decision], selected: Sequence[Launch]) -> list[tuple[str, str]]:
    """(difference, the runs it concerns) in order of first appearance; 'every run' or 'every
    training run' when it concerns all of those selected."""
    groups: dict[str, list[str]] = {}
    for decision in stale:
        for text in decision.differences:
            groups.setdefault(text, []).append(decision.launch.name)
    everyone = [launch.name for launch in selected]
    training = [launch.name for launch in selected if launch.role != "seed"]
    found = []
    for text, names in groups.items():
        if len(names) > 1 and names == everyone:
            who = "every run"
        elif len(names) > 1 and names == training:
            who = "every training run"
        else:
            who = ", ".join(names)
        found.append((text, who))
    return found
