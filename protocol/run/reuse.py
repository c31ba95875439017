"""Whether a run already in its folder can stand for what the plan would run now.

A finished run costs hours of GPU time, so the protocol reuses it, but only when its own record
equals what a run started now would record (ARCHITECTURE invariant 7):

- a training run (trainer.records.run_meta, run_meta.json): status "completed" with every step of the
  plan; the resolved configuration equal to `to_dict(load_config(launch args))`; the same world
  size, trainer source (trainer.version: source_sha256) and torch version; and, when the plan
  uses a seed checkpoint, started from the seed checkpoint that is there now (its fingerprint);
- the seed run: its step-0 checkpoint is complete, and its checkpoint.json names the
  configuration the seed launch resolves to now, the same trainer source and torch version.

A run whose record differs is *stale*, whatever its status: rerunning it in place could resume
from its checkpoints and mix two configurations in one curve. So is every run that starts from a
seed checkpoint that is stale or will be made anew. A run without a record, or with a record
equal to now that did not finish, is simply run (again), unless an early-stop rule that is still
in the plan stopped it (protocol.plan.early_stop): it is then STOPPED, and not run again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.plan.early_stop import applies, stopped
from protocol.plan.model import REPO_ROOT, Launch, Plan, seed_launch
from protocol.plan.records import config_changes, describe_changes, normalized, read_record

REUSE, RUN, STALE, STOPPED = "reuse", "run", "stale", "stopped"
RECORD_FORMAT = 2
# Options that decide only when a run saves, never what it computes (a resume continues the
# curve exactly): a run saved under other values, or under none (runs made before protocol runs
# saved), still describes the plan.
SAVE_ONLY = frozenset({"checkpoint.enable", "checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.load_only",
                       "checkpoint.last_save_model_only"})
# Where the configuration file lay: the values it held are compared option by option, so a run
# made in another clone of the repository (a checkout moved, a second one on the cluster) is
# still the same run.
LOCATION_ONLY = frozenset({"job.config_file"})


@dataclass(frozen=True)
class Decision:
    """What to do with one launch: reuse its run, run it, leave it stopped (an early-stop rule
    ended it), or (stale) not without moving it aside.

    differences: for a stale run, what differs, in words; reason: for a run, why it runs; for a
    stopped one, the rule it broke and its value; resume_from: for a run, the step of the
    checkpoint it resumes from (None: from the start), set by protocol.run.prepare.
    """

    launch: Launch
    action: str
    differences: tuple[str, ...] = ()
    reason: str = ""
    resume_from: int | None = None


@dataclass(frozen=True)
class Now:
    """What a run started now would record about the software."""

    code: dict
    torch: str | None


def current() -> Now:
    from trainer.version import code_version, installed_torch_version

    return Now(code=code_version(), torch=installed_torch_version())


def expected_config(launch: Launch) -> dict:
    """The configuration the launch resolves to, as its record would hold it.

    Resolved from the repository root, where every run starts: a bare config name resolves
    there exactly as in the run.
    """
    from trainer.config.manager import load_config, to_dict

    here = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        return normalized(to_dict(load_config(list(launch.args))))
    finally:
        os.chdir(here)


def assess(plan: Plan, launches: list[Launch], now: Now | None = None) -> dict[str, Decision]:
    """A Decision for every launch, by name; the seed (first when present) decides for the runs
    that start from it."""
    now = now or current()
    decisions: dict[str, Decision] = {}
    seed = None
    for launch in launches:
        if launch.role == "seed":
            seed = decisions[launch.name] = assess_seed(launch, now)
        else:
            decisions[launch.name] = assess_run(plan, launch, now, seed)
    return decisions


def assess_seed(launch: Launch, now: Now) -> Decision:
    from trainer.checkpoint.on_disk import read_checkpoint_record

    checkpoint = launch.seed_checkpoint
    if checkpoint is None or not (checkpoint / ".metadata").is_file():
        return Decision(launch, RUN, reason="no seed checkpoint yet")
    record = read_checkpoint_record(checkpoint)
    if record is None:
        return Decision(launch, STALE, ("its checkpoint has no checkpoint.json (written by an older trainer), so "
                                        "what made it cannot be checked",))
    changes = config_changes(record.get("config"), expected_config(launch), skip=LOCATION_ONLY)
    differences = describe_changes(changes) + code_difference(record.get("code"), now.code)
    if record.get("torch") != now.torch:
        differences.append(f"torch {record.get('torch') or 'not recorded'} -> {now.torch or 'not installed'}")
    return Decision(launch, STALE, tuple(differences)) if differences else Decision(launch, REUSE)


def assess_run(plan: Plan, launch: Launch, now: Now, seed: Decision | None = None) -> Decision:
    """`seed`: the seed run's decision when known (assess), else it is made here."""
    record = read_record(launch.output)
    if record is None:
        return Decision(launch, RUN, reason="no run record yet")
    if record.get("format") != RECORD_FORMAT:
        return Decision(launch, STALE, ("its run_meta.json was written by an older trainer, which did not record "
                                        "enough to check what it ran",))
    if seed is None and plan.seed_checkpoint:
        seed = assess_seed(seed_launch(plan), now)
    differences = record_differences(record, launch, now) + seed_differences(record, launch, now, seed)
    if differences:
        return Decision(launch, STALE, tuple(differences))
    breach = stopped(launch.output, plan.early_stop) if applies(launch) else None
    if breach is not None:
        return Decision(launch, STOPPED, reason=breach.describe())
    incomplete = incompleteness(record, plan.steps)
    if incomplete:
        return Decision(launch, RUN, reason=f"the previous attempt's {incomplete}")
    return Decision(launch, REUSE)


def resume_step(plan: Plan, launch: Launch) -> int | None:
    """The step an unfinished training run resumes from: its newest checkpoint that the trainer
    will load (complete, or finished but not yet renamed into place), else None (from the seed)."""
    from trainer.checkpoint.on_disk import complete_checkpoints, finished_partials

    if launch.role == "seed":
        return None
    folder = launch.output / plan.checkpoint_folder
    steps = [step for step in (*complete_checkpoints(folder), *finished_partials(folder)) if step > 0]
    return max(steps, default=None)


def incompleteness(record: dict, steps: int) -> str | None:
    """Why a run with this record has not finished the plan's steps, or None when it has."""
    status, last = record.get("status"), record.get("last_step") or 0
    if status == "completed" and last >= steps:
        return None
    return f"record says {status or 'no status'!r} at step {last} of {steps}"


def starts(record: dict) -> list[dict]:
    """Every start of the run, oldest first: a resumed run keeps its earlier starts in history."""
    return [*record.get("history", []), record]


def record_differences(record: dict, launch: Launch, now: Now) -> list[str]:
    """What differs between any start of a run and what the launch would record now, in words:
    a run resumed under other options did not run as the plan says either."""
    expected = expected_config(launch)
    found: list[str] = []
    for start in starts(record):
        found += describe_changes(config_changes(start.get("config"), expected, skip=SAVE_ONLY | LOCATION_ONLY))
        if start.get("world_size") != launch.nproc:
            found.append(f"world size {start.get('world_size')} -> {launch.nproc}")
        found += code_difference(start.get("code"), now.code)
        if start.get("torch") != now.torch:
            found.append(f"torch {start.get('torch') or 'not recorded'} -> {now.torch or 'not installed'}")
    return list(dict.fromkeys(found))


def seed_differences(record: dict, launch: Launch, now: Now, seed: Decision | None) -> list[str]:
    """A run that loaded the seed checkpoint is only as current as that checkpoint (its first
    start loaded it; a resume loads the run's own checkpoint)."""
    if launch.seed_checkpoint is None:
        return []
    if seed is not None and seed.action != REUSE:
        return ["it started from the seed checkpoint, which is stale" if seed.action == STALE else
                "it started from a seed checkpoint that is gone and will be made anew"]
    from trainer.checkpoint.on_disk import fingerprint

    started = (starts(record)[0].get("start") or {}).get("fingerprint")
    there = fingerprint(launch.seed_checkpoint)
    if started != there:
        return [f"it started from seed checkpoint {short(started)}, the seed checkpoint now is {short(there)}"]
    return []


def short(fingerprint: str | None) -> str:
    return fingerprint[:8] if fingerprint else "none"


def code_difference(recorded: dict | None, now: dict) -> list[str]:
    """'trainer code changed (3f2a1c9d -> 8b0e44aa (with local changes))' when the trainer's
    source differs; on the same commit the source hashes are added (local edits differ)."""
    from trainer.version import describe

    recorded = recorded or {}
    if recorded.get("source_sha256") == now.get("source_sha256"):
        return []
    if not recorded:
        return ["trainer code not recorded"]
    before, after = describe(recorded), describe(now)
    if recorded.get("commit") == now.get("commit"):
        before += f", source {str(recorded.get('source_sha256'))[:12]}"
        after += f", source {str(now.get('source_sha256'))[:12]}"
    return [f"trainer code changed ({before} -> {after})"]


def stale_notes(plan: Plan, names: Sequence[str]) -> dict[str, list[str]]:
    """Run name -> what differs between its record and what the plan would run now, for the runs
    named (those the report describes from their records)."""
    decisions = assess(plan, plan.launches())
    return {name: list(decision.differences) for name, decision in decisions.items()
            if decision.action == STALE and name in names}


def completion_problem(plan: Plan, launch: Launch, now: Now | None = None) -> str | None:
    """Why a launch that exited 0 did not leave a run the protocol can reuse, or None."""
    now = now or current()
    if launch.role == "seed":
        decision = assess_seed(launch, now)
        if decision.action == RUN:
            return f"no complete seed checkpoint at {launch.seed_checkpoint}"
    else:
        record = read_record(launch.output)
        if record is None:
            return f"no run record ({launch.output / 'run_meta.json'})"
        decision = assess_run(plan, launch, now)
        if decision.action == RUN:
            return f"the run's {incompleteness(record, plan.steps)}"
    if decision.action == STALE:
        return "its record differs from what was launched: " + "; ".join(decision.differences)
    return None

