"""What every launcher does around the runs: choose them, decide which to reuse, refuse or move
aside stale ones, judge how a run ended, and summarize.

Runs are resumable by design: long plans get interrupted, and a finished run costs GPU hours.
Every training run saves checkpoints into its own folder (protocol.plan.save_args), and one that
is run again after an interruption resumes from its newest one. Before anything starts, each selected run is reused, run, or found stale (protocol.reuse). Stale
runs are refused with one message naming every difference and the flag that reruns them
(`--rerun-stale`); with the flag their folders move to `<output>/superseded/` and they run
afresh. A folder at a run's path that the protocol did not create is never written to.

Every run starts in the repository root (where torchrun_launch.sh is); the plan's config and
output paths are absolute, so the working directory only matters for relative paths a user
wrote into overrides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.folders import foreign_folder, supersede
from protocol.plan.model import SUPERSEDED_DIR, Launch, Plan
from protocol.plan.select import LaunchError
from protocol.reuse import RUN, STALE, Decision, assess, resume_step

logger = logging.getLogger(__name__)

RERUN_FLAG = "--rerun-stale"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    """What happened to one launch.

    status: "completed" (ran now and left a reusable run), "already complete" (reused),
    "failed" (see returncode, message, details, log), "skipped" (not run because a run it needs
    failed), "stopped" (an early-stop rule ended it, now or before; message: the rule and the
    value that broke it) or "not needed" (a point of a searched sweep the search did not need).
    message: why it failed, was skipped or stopped, one line; details: the log's error block or
    last lines.
    """

    name: str
    status: str
    returncode: int | None = None
    seconds: float = 0.0
    log: Path | None = None
    message: str = ""
    details: str = ""
    job_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("completed", "already complete")

    @property
    def failed(self) -> bool:
        """It failed, or was skipped because a run it needed did; a stopped run and a search point
        that was not needed are neither: the plan decided not to finish or run them."""
        return self.status in ("failed", "skipped")


def prepare(plan: Plan, selected: Sequence[Launch], rerun_stale: bool, report: Progress) -> dict[str, Decision]:
    """Decide for every selected launch before anything runs; returns name -> Decision (reuse or run).

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
    return decisions


def resume_note(plan: Plan, launch: Launch) -> str:
    """', resuming from step S (<its checkpoint folder>)' for a run that stopped before the end
    and saved a checkpoint (it continues its curve from there), else ''."""
    step = resume_step(plan, launch)
    if step is None:
        return ""
    return f", resuming from step {step} ({launch.output / plan.checkpoint_folder})"


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


def summarize(results: Sequence[RunResult], report: Progress) -> None:
    """The end of a run: every run complete, or each one that is not with why and where its log is
    (stopped runs with their rule, and how many search points were not needed)."""
    unneeded = [r for r in results if r.status == "not needed"]
    stopped = [r for r in results if r.status == "stopped"]
    bad = [r for r in results if r.failed]
    for r in stopped:
        report(f"{r.name}: STOPPED ({r.message})")
    if unneeded:
        report(f"not needed by the search: {', '.join(r.name for r in unneeded)}")
    if not bad:
        done = len(results) - len(unneeded) - len(stopped)
        report(f"all {done} runs complete" if not stopped else f"{done} runs complete, {len(stopped)} stopped")
        return
    for r in bad:
        why = f" ({r.message})" if r.message else ""
        error = next((line for line in r.details.splitlines() if line.startswith("error: ")), None)
        where = f", log: {r.log}" if r.log else ""
        report(f"{r.name}: {r.status.upper()}{why}{where}" + (f"\n    {error}" if error else ""))
