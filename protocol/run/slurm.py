"""Running a plan through SLURM: write the sbatch scripts, submit them (the seed first, the others
after it succeeds), wait for the jobs, and judge each finished job by the run it left.

At every look at the queue, a running test set whose run folder (on the shared file system)
breaks an early-stop rule is marked stopped and cancelled (protocol.plan.early_stop). The points
of searched sweeps are submitted one at a time after the others, as the search needs them
(protocol.run.searches). What to do with each launch is decided once, before the first job is
submitted (protocol.run.prepare).

The SLURM client commands go through a `runner(argv) -> stdout` so tests can pass a fake.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from protocol.plan.early_stop import applies, breach
from protocol.plan.model import Launch, Plan
from protocol.plan.select import LaunchError, select
from protocol.run.failures import indent, summary
from protocol.run.folders import claim_folder, clear_stopped, mark_stopped
from protocol.run.outcome import Progress, RunResult, summarize
from protocol.run.prepare import prepare, resume_note, settled
from protocol.run.reuse import RUN, Decision, completion_problem
from protocol.run.sbatch import check_scripts_folder, job_log, requeues, script_path, write_slurm
from protocol.run.searches import run_searches

logger = logging.getLogger(__name__)

Runner = Callable[[list[str]], str]
# Final states of a SLURM job (sacct); anything else is still queued or running. A training job
# that SLURM preempts and requeues (--requeue) passes through PREEMPTED and runs again.
SLURM_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
REQUEUED_AFTER = {"PREEMPTED", "NODE_FAIL"}  # not final for a job submitted with --requeue
STATE_CAUSES = {
    "OUT_OF_MEMORY": "the job passed its host memory limit; raise mem in the plan's [slurm.seed] or [slurm.train]",
    "TIMEOUT": "the job reached its time limit without saving (save_before_limit is 0, or the save took longer); "
               "raise time or save_before_limit in the plan's [slurm.seed] or [slurm.train]",
}
# Pending reasons that no waiting resolves; the job is reported, and cancelled.
NEVER_STARTS = {"BadConstraints", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                "ReqNodeNotAvail", "InvalidAccount", "InvalidQOS", "DependencyNeverSatisfied"}


def run_command(argv: list[str]) -> str:
    """Run a SLURM client command; its stdout, or LaunchError with its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]}: not found; the SLURM launcher needs a SLURM login node") from None
    if done.returncode:
        raise LaunchError(f"{' '.join(argv[:2])} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def run_slurm(plan: Plan, launches: Sequence[Launch], out_dir: Path, only: Sequence[str] | None = None,
              runner: Runner = run_command, poll: float = 60.0, on_progress: Progress | None = None,
              sleep: Callable[[float], None] = time.sleep, rerun_stale: bool = False) -> list[RunResult]:
    """Submit the runs that are not reused and wait for them; one RunResult per selected launch.

    `poll` is the number of seconds between looks at the queue. If the seed job fails, the jobs
    waiting on it are cancelled and reported as skipped. Without `only`, the points of searched
    sweeps are submitted last, one at a time, those the search needs.
    """
    report = on_progress or logger.info
    check_scripts_folder(out_dir)  # before any run folder is touched
    selected = select(launches, only)
    decisions = prepare(plan, selected, rerun_stale, report)
    out_dir = Path(out_dir).absolute()
    later = [launch for launch in selected if not only and launch.search]
    results = {launch.name: done for launch in selected if launch not in later
               and (done := settled(decisions[launch.name], launch.name, report)) is not None}
    to_run = [launch for launch in selected if decisions[launch.name].action == RUN]
    if to_run:
        write_slurm(plan, to_run, out_dir, report)
    pending = [decisions[launch.name] for launch in to_run if launch not in later]
    if pending:
        jobs = submit(plan, pending, out_dir, runner, report)
        results.update(wait_for_jobs(plan, jobs, out_dir, runner, poll, report, sleep))

    def run_point(launch: Launch) -> RunResult:
        blocked = [name for name in launch.depends_on if name in results and results[name].failed]
        if blocked:
            return RunResult(launch.name, "skipped", message=f"needs {', '.join(blocked)}, which did not complete")
        done = settled(decisions[launch.name], launch.name, report)
        if done is not None:
            return done
        jobs = submit(plan, [decisions[launch.name]], out_dir, runner, report)
        return wait_for_jobs(plan, jobs, out_dir, runner, poll, report, sleep)[launch.name]

    if later:
        results.update(run_searches(plan, later, run_point, report))
    ordered = [results[launch.name] for launch in selected]
    summarize(ordered, report)
    return ordered


def submit(plan: Plan, decisions: Sequence[Decision], out_dir: Path, runner: Runner,
           report: Progress) -> dict[str, tuple[Launch, str]]:
    """sbatch --parsable the script of each launch to run; name -> (launch, job id)."""
    jobs: dict[str, tuple[Launch, str]] = {}
    for decision in decisions:
        launch = decision.launch
        claim_folder(plan, launch)
        clear_stopped(launch.output)  # stopped under rules the plan no longer has: it runs on
        argv = ["sbatch", "--parsable"]
        needed = [jobs[name][1] for name in launch.depends_on if name in jobs]
        if needed:  # SLURM cancels it when the seed fails, instead of keeping it pending forever
            argv += ["--dependency=afterok:" + ":".join(needed), "--kill-on-invalid-dep=yes"]
        job_id = runner([*argv, str(script_path(out_dir, launch))]).strip().split(";")[0]
        jobs[launch.name] = (launch, job_id)
        report(f"{launch.name}: submitted as job {job_id}" + (f" (after job {', '.join(needed)})" if needed else "")
               + resume_note(plan, decision))
    return jobs


def job_states(job_ids: Sequence[str], runner: Runner) -> dict[str, tuple[str, str]]:
    """Job id -> (state, squeue's reason): sacct's state when it knows the job, else squeue's
    (which lists finished jobs too, for the controller's MinJobAge); jobs neither lists are absent."""
    ids = ",".join(job_ids)
    states: dict[str, tuple[str, str]] = {}
    try:
        for line in runner(["squeue", "-h", "-t", "all", "-j", ids, "-o", "%i %T %r"]).splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) >= 2:
                states[parts[0]] = (parts[1], parts[2] if len(parts) > 2 and parts[2] != "None" else "")
    except LaunchError:
        pass  # squeue refuses ids that left the queue; sacct knows them
    try:
        for line in runner(["sacct", "-n", "-P", "-X", "-j", ids, "-o", "JobID,State"]).splitlines():
            job, _, state = line.partition("|")
            if job.strip() in job_ids and state.strip():
                states[job.strip()] = (state.split()[0].rstrip("+"), states.get(job.strip(), ("", ""))[1])
    except LaunchError:
        pass  # no accounting on this cluster: squeue alone decides
    return states


def job_details(job_id: str, runner: Runner) -> dict[str, str]:
    """scontrol's fields of a job the controller still holds (JobState, Reason, ExitCode, ...);
    empty once it has forgotten the job."""
    try:
        text = runner(["scontrol", "show", "job", "-o", job_id])
    except LaunchError:
        return {}
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait_for_jobs(plan: Plan, jobs: dict[str, tuple[Launch, str]], out_dir: Path, runner: Runner, poll: float,
                  report: Progress, sleep: Callable[[float], None]) -> dict[str, RunResult]:
    results: dict[str, RunResult] = {}
    seen: dict[str, tuple[str, str]] = {}
    began = time.monotonic()
    while len(results) < len(jobs):
        waiting = {name: job for name, job in jobs.items() if name not in results}
        states = job_states([job_id for _, job_id in waiting.values()], runner)
        for name, (launch, job_id) in waiting.items():
            state, reason = states.get(job_id, ("GONE", ""))
            if seen.get(name) != (state, reason) and state != "GONE":
                report(f"{name}: job {job_id} {state}" + (f" ({reason})" if reason else ""))
                seen[name] = (state, reason)
            if state in REQUEUED_AFTER and requeues(plan, launch):
                continue  # SLURM runs it again; it resumes from its checkpoint
            if any(results[dep].failed for dep in launch.depends_on if dep in results):
                continue  # skipped below (cancel_orphans), whatever SLURM did with it
            if state in SLURM_FINAL or state == "GONE":
                results[name] = job_result(plan, launch, job_id, state, out_dir, time.monotonic() - began, runner)
                report_result(results[name], report)
            elif state == "PENDING" and reason.split(",")[0] in NEVER_STARTS:
                results[name] = never_starts(launch, job_id, reason, runner)
                report_result(results[name], report)
            elif state == "RUNNING" and applies(launch):
                stopped = stop_if_broken(plan, launch, job_id, runner, time.monotonic() - began)
                if stopped is not None:
                    results[name] = stopped
                    report(f"{name}: STOPPED (job {job_id} cancelled) by {stopped.message}")
        cancel_orphans(jobs, results, states, runner, report)
        if len(results) < len(jobs):
            sleep(poll)
    return results


def never_starts(launch: Launch, job_id: str, reason: str, runner: Runner) -> RunResult:
    """A job SLURM will not start as asked (a partition's limits, a node it does not have): cancel it."""
    try:
        runner(["scancel", job_id])
    except LaunchError:
        pass
    message = (f"job {job_id} cannot start: pending with reason {reason}; fix the plan's [slurm] options "
               "(partition, time, nodes, GPUs or CPUs per node) and run again; job cancelled")
    return RunResult(launch.name, "failed", None, 0.0, None, message, job_id=job_id)


def stop_if_broken(plan: Plan, launch: Launch, job_id: str, runner: Runner, seconds: float) -> RunResult | None:
    """Cancel a running job whose run breaks an early-stop rule (marked first, so that the reason
    stays if cancelling fails); its result, or None while no rule is broken."""
    broke = breach(plan.early_stop, launch.output)
    if broke is None:
        return None
    mark_stopped(launch.output, broke)
    runner(["scancel", job_id])
    return RunResult(launch.name, "stopped", None, seconds, None, broke.describe(), job_id=job_id)


def job_result(plan: Plan, launch: Launch, job_id: str, state: str, out_dir: Path, seconds: float,
               runner: Runner) -> RunResult:
    """A finished job's result; a job that left no accounting record ("GONE") is judged by its run.
    A failed one names its state, exit code and SLURM's reason (scontrol, while the controller
    still holds the job), its log, and the error the log ends with."""
    log = job_log(out_dir, launch, job_id)
    problem = completion_problem(plan, launch)
    if state in ("COMPLETED", "GONE") and not problem:
        return RunResult(launch.name, "completed", 0, seconds, log, job_id=job_id)
    details = job_details(job_id, runner)
    how = ", ".join(f"{label} {details[key]}" for key, label in (("ExitCode", "exit code"), ("Reason", "reason"))
                    if details.get(key) not in (None, "", "None", "0:0"))
    why = f"job {job_id} {state}" + (f" ({how})" if how else "")
    if state in STATE_CAUSES:
        why += f": {STATE_CAUSES[state]}"
    elif state == "COMPLETED":
        why += f", but {problem}"
    elif state == "GONE":
        why = f"job {job_id} left the queue, {problem}"
    title, text = summary(log)
    if title == "error":  # the launcher's own message: its first line names the cause
        why += f"; {text.splitlines()[0]}"
    why += f"; log: {log}"
    return RunResult(launch.name, "failed", None, seconds, log, why, text, job_id)


def report_result(result: RunResult, report: Progress) -> None:
    if result.ok:
        report(f"{result.name}: done")
    else:
        report(f"{result.name}: FAILED ({result.message}), log: {result.log}\n{indent(result.details)}")


def cancel_orphans(jobs: dict[str, tuple[Launch, str]], results: dict[str, RunResult],
                   states: dict[str, tuple[str, str]], runner: Runner, report: Progress) -> None:
    """Jobs waiting (afterok) on a failed job would wait forever: SLURM cancels them
    (--kill-on-invalid-dep), else this does; they are reported skipped."""
    failed = {name for name, result in results.items() if result.failed}
    for name, (launch, job_id) in jobs.items():
        blocked = [dep for dep in launch.depends_on if dep in failed]
        if name in results or not blocked:
            continue
        if states.get(job_id, ("GONE", ""))[0] in SLURM_FINAL | {"GONE"}:  # SLURM has ended it already
            how = f"SLURM cancelled job {job_id}"
        else:
            how = f"job {job_id} cancelled"
            try:
                runner(["scancel", job_id])
            except LaunchError as e:
                report(f"{name}: could not cancel job {job_id}: {e}")
        message = f"needs {', '.join(blocked)}, which did not complete; {how}"
        results[name] = RunResult(name, "skipped", message=message, job_id=job_id)
        report(f"{name}: skipped, {message}")
