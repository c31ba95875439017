"""Rendering a plan's launches (table, JSON, shell script, SLURM scripts) and running them.

Runs are resumable by design: long plans get interrupted, and a finished run costs GPU hours.
A run folder holds `.protocol-run` (written before the run starts: which plan and run it belongs
to) and, once the run exited 0 with metrics.jsonl reaching the plan's last step,
`.protocol-complete`. A completed run is skipped when the plan runs again. A folder at a run's
output path without `.protocol-run` belongs to someone else: the protocol refuses to write there
instead of mixing its files with a user's.

Every run starts in the repository root (where torchrun_launch.sh is); the plan's config and
output paths are absolute, so the working directory only matters for relative paths a user
wrote into overrides.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from protocol.plan import REPO_ROOT, RDZV_PORT, Launch, Plan, option_value, slugify

logger = logging.getLogger(__name__)

LAUNCHER = REPO_ROOT / "torchrun_launch.sh"
RUN_MARKER = ".protocol-run"
COMPLETE_MARKER = ".protocol-complete"
LOG_NAME = "protocol.log"
METRICS_FILE = "metrics.jsonl"
TAIL_LINES = 15
FORMATS = ("table", "json", "shell")
# Final states of a SLURM job (sacct); anything else is still queued or running.
SLURM_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}

Progress = Callable[[str], None]
Runner = Callable[[list[str]], str]


class LaunchError(ValueError):
    """A request that cannot be carried out as asked (unknown run name, a foreign folder in the way)."""


@dataclass(frozen=True)
class RunResult:
    """What happened to one launch.

    status: "completed" (ran now, exit 0, all steps logged), "already complete" (skipped, a
    previous attempt completed), "failed" (see returncode, log, message) or "skipped" (not run
    because a run it needs failed).
    """

    name: str
    status: str
    returncode: int | None = None
    seconds: float = 0.0
    log: Path | None = None
    message: str = ""
    job_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("completed", "already complete")


# ---------------------------------------------------------------------------------------------
# Rendering


def describe_degrees(degrees: dict) -> str:
    """'dp_shard 2, tp 2, pp 2 (Interleaved1F1B)': data-parallel sharding always, the rest when used."""
    if not degrees:
        return "1 process"
    parts = [f"{key} {degrees[key]}" for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp")
             if key == "dp_shard" or degrees.get(key, 1) != 1]
    if degrees.get("pp_schedule"):
        parts[-1] += f" ({degrees['pp_schedule']})"
    return ", ".join(parts)


def describe_layout(launch: Launch) -> str:
    """The degrees and the run's own trainer options: 'dp_shard 2 + activation_checkpoint.mode=full'."""
    options = [f"{key}={option_value(value)}" for key, value in launch.overrides.items()]
    return " + ".join([describe_degrees(launch.degrees), *options])


def render(launches: Sequence[Launch], fmt: str) -> str:
    """The launches as an aligned `table`, a `json` list, or a runnable bash script (`shell`)."""
    renderers = {"table": render_table, "json": render_json, "shell": render_shell}
    if fmt not in renderers:
        raise LaunchError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return renderers[fmt](launches)


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


def render_json(launches: Sequence[Launch]) -> str:
    return json.dumps([launch.to_dict() for launch in launches], indent=2)


def render_shell(launches: Sequence[Launch]) -> str:
    """One node runs the runs in order; runs needing several nodes are listed, commented out."""
    out = ["#!/usr/bin/env bash", "# Convergence protocol launches, in order (the seed checkpoint first).",
           "set -euo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}", ""]
    for i, launch in enumerate(launches, 1):
        head = f"[{i}/{len(launches)}] {launch.name}"
        if launch.nodes > 1:
            out += [f"# {head}: needs {launch.nodes} nodes of {launch.procs_per_node}; run this on every node with "
                    "HEAD_NODE set, or use the SLURM scripts (protocol plan --format slurm):",
                    f"# {launch.command()}",
                    f"echo {shlex.quote(head + ': skipped here, needs ' + str(launch.nodes) + ' nodes')}", ""]
        else:
            out += [f"echo {shlex.quote(head)}", launch.command(), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# SLURM scripts


def sbatch_script(plan: Plan, launch: Launch, log_path: Path) -> str:
    """One job: the seed as a single process, every other run through torchrun's c10d rendezvous
    (one torchrun per node, started by srun; the first host of the allocation is the endpoint)."""
    root = shlex.quote(str(REPO_ROOT))
    args = shlex.join(launch.args)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={slugify(plan.name)}-{launch.slug}",
        f"#SBATCH --nodes={launch.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={launch.procs_per_node}",
        f"#SBATCH --output={log_path}",
        "set -euo pipefail",
        f"cd {root}",
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
        'if [ -z "${PYTHON:-}" ]; then',
        '  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON=python',
        '  elif [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"',
        "  else PYTHON=python3; fi",
        "fi",
        f"echo {shlex.quote(f'protocol run {launch.name}: {launch.nproc} process(es)')} "
        '"on $SLURM_NNODES node(s), job $SLURM_JOB_ID"',
    ]
    if launch.role == "seed":
        lines.append(f'srun --ntasks=1 "$PYTHON" -m trainer.train {args}')
    else:
        lines += [
            f'"$PYTHON" -m trainer.preflight --nproc {launch.nproc} --device cuda {args}',
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" '
            f'--nproc_per_node {launch.procs_per_node} --rdzv_backend c10d --rdzv_endpoint "$head:{RDZV_PORT}" '
            f'--rdzv_id "$SLURM_JOB_ID" -m trainer.train {args}',
        ]
    return "\n".join(lines) + "\n"


def script_path(out_dir: Path, launch: Launch) -> Path:
    return out_dir / f"{launch.slug}.sbatch"


def slurm_log_pattern(out_dir: Path, launch: Launch) -> Path:
    """The log of a job: SLURM replaces %j with the job id (the folder must exist before submission)."""
    return out_dir / f"{launch.slug}-%j.log"


def submit_all_script(launches: Sequence[Launch], out_dir: Path) -> str:
    """Submits the seed first; every run that needs it waits for it (afterok)."""
    lines = ["#!/usr/bin/env bash", "# Submit the protocol's jobs; runs needing the seed checkpoint wait for it.",
             "set -euo pipefail", 'cd "$(dirname "${BASH_SOURCE[0]}")"']
    seeds = [launch for launch in launches if launch.role == "seed"]
    for launch in seeds:
        lines += [f"seed=$(sbatch --parsable {shlex.quote(script_path(out_dir, launch).name)})",
                  'seed="${seed%%;*}"  # --parsable prints JOBID[;CLUSTER]', 'echo "seed: job $seed"']
    for launch in launches:
        if launch.role == "seed":
            continue
        dependency = "--dependency=afterok:$seed " if seeds and launch.depends_on else ""
        name = shlex.quote(script_path(out_dir, launch).name)
        lines.append(f"echo \"{launch.slug}: job $(sbatch --parsable {dependency}{name})\"")
    return "\n".join(lines) + "\n"


def write_slurm(plan: Plan, launches: Sequence[Launch], out_dir: Path) -> list[Path]:
    """One sbatch script per launch (`<slug>.sbatch`, logs `<slug>-<job id>.log` next to it) and
    `submit_all.sh`; returns their paths, the scripts in launch order, submit_all.sh last."""
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for launch in launches:
        path = script_path(out_dir, launch)
        path.write_text(sbatch_script(plan, launch, slurm_log_pattern(out_dir, launch)))
        path.chmod(0o755)
        paths.append(path)
    submit = out_dir / "submit_all.sh"
    submit.write_text(submit_all_script(launches, out_dir))
    submit.chmod(0o755)
    return paths + [submit]


# ---------------------------------------------------------------------------------------------
# Selection, run folders and completion


def select(launches: Sequence[Launch], only: Sequence[str] | None) -> list[Launch]:
    """The launches named in `only` (names or their slugs) plus what they depend on, in plan order."""
    if not only:
        return list(launches)
    by_key = {}
    for launch in launches:
        by_key[launch.name] = by_key[launch.slug] = launch
    unknown = [name for name in only if name not in by_key]
    if unknown:
        valid = ", ".join(repr(launch.name) for launch in launches)
        raise LaunchError(f"unknown run name(s) {', '.join(map(repr, unknown))}; the plan's runs are: {valid}")
    chosen = {by_key[name].name for name in only}
    for launch in launches:
        if launch.name in chosen:
            chosen.update(launch.depends_on)  # a needed seed run is skipped anyway once complete
    return [launch for launch in launches if launch.name in chosen]


def is_complete(launch: Launch) -> bool:
    """The seed: its step-0 checkpoint is complete. A run: its completion marker exists."""
    if launch.role == "seed":
        return launch.seed_checkpoint is not None and (launch.seed_checkpoint / ".metadata").is_file()
    return (launch.output / COMPLETE_MARKER).is_file()


def run_identity(plan: Plan, launch: Launch) -> dict:
    return {"plan": plan.name, "run": launch.name}


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
    if {k: owner.get(k) for k in ("plan", "run")} != run_identity(plan, launch):
        return (f"{folder} belongs to run {owner.get('run')!r} of plan {owner.get('plan')!r}; give this plan "
                "another plan.output")
    return None


def check_folders(plan: Plan, launches: Sequence[Launch]) -> None:
    """Refuse before anything runs, naming every folder in the way."""
    problems = [why for launch in launches if (why := foreign_folder(plan, launch))]
    if problems:
        raise LaunchError("refusing to write into folders the protocol did not create:\n  " + "\n  ".join(problems))


def claim_folder(plan: Plan, launch: Launch) -> None:
    launch.output.mkdir(parents=True, exist_ok=True)
    marker = launch.output / RUN_MARKER
    if not marker.exists():
        identity = {**run_identity(plan, launch), "created": now(), "command": launch.command()}
        marker.write_text(json.dumps(identity, indent=2) + "\n")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def last_step(output: Path) -> int:
    """The highest training step in metrics.jsonl (0 when absent); other records have a "kind"."""
    path = output / METRICS_FILE
    if not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(record, dict) and "kind" not in record and isinstance(record.get("step"), int):
            step = max(step, record["step"])
    return step


def completion_problem(plan: Plan, launch: Launch) -> str | None:
    """Why a run that exited 0 is still not complete, or None."""
    if launch.role == "seed":
        return None if is_complete(launch) else f"no complete seed checkpoint at {launch.seed_checkpoint}"
    step = last_step(launch.output)
    if step < plan.steps:
        return f"{METRICS_FILE} reaches step {step} of {plan.steps}"
    return None


def mark_complete(launch: Launch, seconds: float) -> None:
    if launch.role != "seed":
        info = {"completed": now(), "seconds": round(seconds, 1), "steps": last_step(launch.output)}
        (launch.output / COMPLETE_MARKER).write_text(json.dumps(info) + "\n")


def tail(path: Path, start: int = 0, lines: int = TAIL_LINES) -> str:
    """The last lines of a log written since byte offset `start`."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# Local runs


def run_local(plan: Plan, launches: Sequence[Launch], only: Sequence[str] | None = None,
              on_progress: Progress | None = None, launcher: Sequence[str] | None = None,
              progress_interval: float = 60.0) -> list[RunResult]:
    """Run the launches on this node, one after another; return one RunResult per selected launch.

    Completed runs are skipped; a failed run is reported (exit code, log, last lines) and the
    others still run, except those needing a seed checkpoint that failed. `launcher` replaces
    torchrun_launch.sh (tests use a fake); `progress_interval` is how often the step a running run
    reached is reported.
    """
    report = on_progress or logger.info
    selected = select(launches, only)
    too_big = [f"{launch.name!r} ({launch.nodes} nodes)" for launch in selected if launch.nodes > 1]
    if too_big:
        raise LaunchError(f"runs needing several nodes cannot run locally: {', '.join(too_big)}; use the SLURM "
                          "launcher, or --only with single-node runs")
    check_folders(plan, selected)
    command = list(launcher) if launcher else [str(LAUNCHER)]
    results: list[RunResult] = []
    failed: set[str] = set()
    for i, launch in enumerate(selected, 1):
        head = f"[{i}/{len(selected)}] {launch.name}"
        result = run_one(plan, launch, command, head, failed, report, progress_interval)
        if not result.ok:
            failed.add(launch.name)
        results.append(result)
    summarize(results, report)
    return results


def run_one(plan: Plan, launch: Launch, command: list[str], head: str, failed: set[str], report: Progress,
            progress_interval: float) -> RunResult:
    blocked = [name for name in launch.depends_on if name in failed]
    if blocked:
        report(f"{head}: skipped, it needs {', '.join(blocked)}, which did not complete")
        return RunResult(launch.name, "skipped", message=f"needs {', '.join(blocked)}, which did not complete")
    if is_complete(launch):
        report(f"{head}: already complete, skipped")
        return RunResult(launch.name, "already complete", log=launch.output / LOG_NAME)
    claim_folder(plan, launch)
    report(f"{head}: running {launch.nproc} process{'es' if launch.nproc > 1 else ''} ... "
           f"(log: {launch.output / LOG_NAME})")
    returncode, seconds, start = execute(plan, launch, command, head, report, progress_interval)
    log = launch.output / LOG_NAME
    problem = f"exit {returncode}" if returncode else completion_problem(plan, launch)
    if problem:
        lines = tail(log, start)
        report(f"{head}: FAILED ({problem}), log: {log}, last lines:\n{indent(lines)}")
        return RunResult(launch.name, "failed", returncode, seconds, log, f"{problem}; last lines:\n{lines}")
    mark_complete(launch, seconds)
    report(f"{head}: done in {seconds:.1f} s")
    return RunResult(launch.name, "completed", returncode, seconds, log)


def execute(plan: Plan, launch: Launch, command: list[str], head: str, report: Progress,
            progress_interval: float) -> tuple[int, float, int]:
    """Start the launcher, wait, report the step reached now and then; (exit code, seconds, log offset).

    The log is appended to, so the output of earlier attempts stays readable above a header line.
    """
    env = dict(os.environ)
    if launch.role != "seed":
        env["NGPU"] = str(launch.nproc)
    log = launch.output / LOG_NAME
    with open(log, "ab") as f:
        start = f.tell()
        f.write(f"=== {now()}: {launch.command()}\n".encode())
        f.flush()
        began = time.monotonic()
        proc = subprocess.Popen([*command, *launch.args], cwd=REPO_ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            returncode = wait(proc, launch, plan.steps, head, report, progress_interval)
        except BaseException:
            stop(proc)
            raise
    return returncode, time.monotonic() - began, start


def wait(proc: subprocess.Popen, launch: Launch, steps: int, head: str, report: Progress, interval: float) -> int:
    reported = 0
    while True:
        try:
            return proc.wait(timeout=interval)
        except subprocess.TimeoutExpired:
            step = last_step(launch.output) if launch.role != "seed" else 0
            if step > reported:
                report(f"{head}: step {step}/{steps}")
                reported = step


def stop(proc: subprocess.Popen) -> None:
    """Interrupted (Ctrl-C): end the child, then give up on it politely."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def summarize(results: Sequence[RunResult], report: Progress) -> None:
    bad = [r for r in results if not r.ok]
    if not bad:
        report(f"all {len(results)} runs complete")
        return
    for r in bad:
        where = f", log: {r.log}" if r.log else ""
        report(f"{r.name}: {r.status.upper()}{where}")


# ---------------------------------------------------------------------------------------------
# SLURM


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
              sleep: Callable[[float], None] = time.sleep) -> list[RunResult]:
    """Write the sbatch scripts, submit them (the seed first, the others after it succeeds) and wait.

    `runner(argv) -> stdout` runs sbatch, squeue, sacct and scancel (tests pass a fake); `poll` is
    the number of seconds between looks at the queue. If the seed job fails, the jobs waiting on
    it are cancelled and reported as skipped.
    """
    report = on_progress or logger.info
    selected = select(launches, only)
    check_folders(plan, selected)
    pending = [launch for launch in selected if not is_complete(launch)]
    results = {launch.name: RunResult(launch.name, "already complete") for launch in selected
               if launch not in pending}
    for name in results:
        report(f"{name}: already complete, skipped")
    if pending:
        write_slurm(plan, pending, out_dir)
        jobs = submit(plan, pending, Path(out_dir).absolute(), runner, report)
        results.update(wait_for_jobs(plan, jobs, Path(out_dir).absolute(), runner, poll, report, sleep))
    ordered = [results[launch.name] for launch in selected]
    summarize(ordered, report)
    return ordered


def submit(plan: Plan, launches: Sequence[Launch], out_dir: Path, runner: Runner,
           report: Progress) -> dict[str, tuple[Launch, str]]:
    """sbatch --parsable each script; name -> (launch, job id)."""
    jobs: dict[str, tuple[Launch, str]] = {}
    for launch in launches:
        claim_folder(plan, launch)
        argv = ["sbatch", "--parsable"]
        needed = [jobs[name][1] for name in launch.depends_on if name in jobs]
        if needed:
            argv.append("--dependency=afterok:" + ":".join(needed))
        job_id = runner([*argv, str(script_path(out_dir, launch))]).strip().split(";")[0]
        jobs[launch.name] = (launch, job_id)
        report(f"{launch.name}: submitted as job {job_id}" + (f" (after job {', '.join(needed)})" if needed else ""))
    return jobs


def job_states(job_ids: Sequence[str], runner: Runner) -> dict[str, str]:
    """Job id -> state: sacct's when it knows the job, else squeue's; jobs neither lists are absent."""
    ids = ",".join(job_ids)
    states: dict[str, str] = {}
    try:
        for line in runner(["squeue", "-h", "-j", ids, "-o", "%i %T"]).splitlines():
            parts = line.split()
            if len(parts) >= 2:
                states[parts[0]] = parts[1]
    except LaunchError:
        pass  # squeue refuses ids that left the queue; sacct knows them
    try:
        for line in runner(["sacct", "-n", "-P", "-X", "-j", ids, "-o", "JobID,State"]).splitlines():
            job, _, state = line.partition("|")
            if job.strip() in job_ids and state.strip():
                states[job.strip()] = state.split()[0].rstrip("+")
    except LaunchError:
        pass  # no accounting on this cluster: squeue alone decides
    return states


def wait_for_jobs(plan: Plan, jobs: dict[str, tuple[Launch, str]], out_dir: Path, runner: Runner, poll: float,
                  report: Progress, sleep: Callable[[float], None]) -> dict[str, RunResult]:
    results: dict[str, RunResult] = {}
    seen: dict[str, str] = {}
    began = time.monotonic()
    while len(results) < len(jobs):
        waiting = {name: job for name, job in jobs.items() if name not in results}
        states = job_states([job_id for _, job_id in waiting.values()], runner)
        for name, (launch, job_id) in waiting.items():
            state = states.get(job_id, "GONE")
            if seen.get(name) != state and state != "GONE":
                report(f"{name}: job {job_id} {state}")
                seen[name] = state
            if state in SLURM_FINAL or state == "GONE":
                results[name] = job_result(plan, launch, job_id, state, out_dir, time.monotonic() - began)
                report_result(results[name], report)
        cancel_orphans(jobs, results, runner, report)
        if len(results) < len(jobs):
            sleep(poll)
    return results


def job_result(plan: Plan, launch: Launch, job_id: str, state: str, out_dir: Path, seconds: float) -> RunResult:
    """A finished job's result; a job that left no accounting record ("GONE") is judged by its files."""
    log = out_dir / f"{launch.slug}-{job_id}.log"
    problem = completion_problem(plan, launch)
    if state in ("COMPLETED", "GONE") and not problem:
        mark_complete(launch, seconds)
        return RunResult(launch.name, "completed", 0, seconds, log, job_id=job_id)
    why = f"job {job_id} {state}" + (f", {problem}" if problem and state == "COMPLETED" else "")
    if state == "GONE":
        why = f"job {job_id} left the queue, {problem}"
    return RunResult(launch.name, "failed", None, seconds, log, f"{why}; last lines:\n{tail(log)}", job_id)


def report_result(result: RunResult, report: Progress) -> None:
    if result.ok:
        report(f"{result.name}: done")
    else:
        report(f"{result.name}: FAILED ({result.message.splitlines()[0]}), log: {result.log}")


def cancel_orphans(jobs: dict[str, tuple[Launch, str]], results: dict[str, RunResult], runner: Runner,
                   report: Progress) -> None:
    """Jobs waiting (afterok) on a failed job would wait forever: cancel them, report them skipped."""
    failed = {name for name, result in results.items() if not result.ok}
    for name, (launch, job_id) in jobs.items():
        blocked = [dep for dep in launch.depends_on if dep in failed]
        if name in results or not blocked:
            continue
        try:
            runner(["scancel", job_id])
        except LaunchError as e:
            report(f"{name}: could not cancel job {job_id}: {e}")
        message = f"needs {', '.join(blocked)}, which did not complete; job {job_id} cancelled"
        results[name] = RunResult(name, "skipped", message=message, job_id=job_id)
        report(f"{name}: skipped, {message}")
