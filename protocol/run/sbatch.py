"""SLURM scripts of a plan: one sbatch script per run and a `submit_all.sh`.

The seed job is one process that needs no GPU (it initializes the model on the CPU) but the
whole model in host memory; every other job starts the trainer's launcher (trainer/launch/launcher.py)
once per node through srun, with a c10d rendezvous on the first node of the allocation. The
launcher checks the configuration first and ends a failed run with one `error:` block. Each script
claims its run folder (`.protocol-run`) before the run starts, so `protocol run` and `protocol
compare` recognize the runs it made. The plan's [slurm] tables add #SBATCH options, shell lines
(`prologue`) and srun options per kind of job.

A training job survives its time limit: SLURM signals it `save_before_limit` seconds before
(`--signal`), the ranks save a checkpoint and stop with exit 75 (trainer/launch/stop_request.py), and the
script requeues its own job (at most `max_requeues` times), which resumes from that checkpoint.
Its log is appended to (`--open-mode=append`), one attempt after the other. A script edited by
hand is never overwritten (protocol.run.script_files).

Every value in a script is quoted (shlex.quote), but on the #SBATCH lines, which sbatch reads
itself: what goes there is checked when the plan is loaded (protocol.plan.text), a control
character is refused again here, and so is a scripts' folder that a log path cannot hold.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from protocol.plan.model import REPO_ROOT, Launch, Plan, SlurmJob, slugify
from protocol.plan.select import LaunchError
from protocol.plan.text import CONTROL, SBATCH_RULE, describe
from protocol.run.folders import CLAIM_FUNCTION, claim_command
from protocol.run.render import unless_seed_exists
from protocol.run.script_files import write_script
from trainer.launch.stop_request import DEFAULT_SIGNAL, SAVED_AND_STOPPED

SUBMIT_ALL = "submit_all.sh"
LOG_FOLDER_SPECIAL = re.compile(r"""[\s'"\\#%\x00-\x1f\x7f-\x9f\u2028\u2029]""")
STOP_SIGNAL_KEY = "checkpoint.save_on_signal"


def sbatch_script(plan: Plan, launch: Launch, log_path: Path) -> str:
    """One job: the seed as a single process, every other run through a c10d rendezvous."""
    return "\n".join([*sbatch_header(plan, launch, log_path), *job_body(plan, launch)]) + "\n"


def sbatch_header(plan: Plan, launch: Launch, log_path: Path) -> list[str]:
    job = plan.slurm_job(launch)
    options = [f"--job-name={slugify(plan.name)}-{launch.slug}", f"--nodes={launch.nodes}"]
    if launch.role == "seed":
        options.append("--ntasks=1")  # and no GPU: the seed is made on the CPU
    else:
        options.append("--ntasks-per-node=1")  # the launcher, which starts the node's ranks
        if job.device == "cuda":
            options.append(f"--gpus-per-node={launch.procs_per_node}")
        elif job.cpus_per_task is None:
            options.append(f"--cpus-per-task={launch.procs_per_node}")  # a CPU per rank
    options += [f"--output={log_path}", "--open-mode=append"]
    if requeues(plan, launch):
        options += [f"--signal={stop_signal(plan, launch).removeprefix('SIG')}@{job.save_before_limit}", "--requeue"]
    return ["#!/bin/bash", *(sbatch_line(option) for option in [*options, *job.sbatch_options()])]


def sbatch_line(option: str) -> str:
    """`#SBATCH option`. sbatch reads these lines itself, so nothing can be quoted there: a line break
    would end the comment and start a command (the plan's loader refuses them; this does not count on it)."""
    found = CONTROL.search(option)
    if found:
        raise LaunchError(f"#SBATCH {option!r} holds a control character ({describe(found.group())}), which would end "
                          "the line; remove it from the plan")
    return f"#SBATCH {option}"


def check_scripts_folder(out_dir: Path) -> None:
    """Refuse a folder whose path #SBATCH --output cannot hold (the jobs' logs are written there):
    sbatch splits its lines at whitespace and reads quotes, backslashes and # itself, and SLURM
    reads % in a log path as a pattern (%j: the job id)."""
    found = LOG_FOLDER_SPECIAL.search(str(Path(out_dir).absolute()))
    if found:
        char = found.group()
        what = "a space" if char == " " else describe(char) if char.isspace() or CONTROL.match(char) else repr(char)
        raise LaunchError(f"{Path(out_dir).absolute()}: the SLURM scripts' folder holds {what}, which #SBATCH --output "
                          f"cannot hold ({SBATCH_RULE}, and % begins a pattern); choose a folder without it (plan.output, "
                          "or --out)")


def stop_signal(plan: Plan, launch: Launch) -> str | None:
    """The signal on which the run saves and stops (checkpoint.save_on_signal), None for "none"."""
    value = {**plan.overrides, **launch.overrides}.get(STOP_SIGNAL_KEY, DEFAULT_SIGNAL)
    return None if value == "none" else value


def requeues(plan: Plan, launch: Launch) -> bool:
    """Whether the job is warned before its time limit and requeues itself after saving (a
    training job, with save_before_limit and a stop signal)."""
    return (launch.role != "seed" and plan.slurm_job(launch).save_before_limit > 0
            and stop_signal(plan, launch) is not None)


def job_body(plan: Plan, launch: Launch) -> list[str]:
    job = plan.slurm_job(launch)
    args = shlex.join(launch.args)
    srun_options = "".join(f"{shlex.quote(option)} " for option in job.srun_options)
    lines = [
        "set -euo pipefail",
        f"cd {shlex.quote(str(REPO_ROOT))}",
        *job.prologue,
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
        'if [ -z "${PYTHON:-}" ]; then',
        '  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON=python',
        f"  elif [ -x {shlex.quote(sys.executable)} ]; then PYTHON={shlex.quote(sys.executable)}  # what wrote this script",
        '  elif [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"',
        "  else PYTHON=python3; fi",
        "fi",
        "# srun does not pass the job's --cpus-per-task on to its tasks by itself (SLURM 22.05 and later)",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
        CLAIM_FUNCTION,
        claim_command(plan, launch),
        f"echo {shlex.quote(f'protocol run {launch.name}: {launch.nproc} process(es)')} "
        '"on $SLURM_NNODES node(s), job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1))"',
    ]
    if launch.role == "seed":
        seed = [f'srun --ntasks=1 {srun_options}"$PYTHON" -m trainer.launch --nproc 1 --device cpu {args}']
        return lines + unless_seed_exists(launch, seed, "seed")
    return lines + [
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "status=0",
        f'srun --kill-on-bad-exit=1 {srun_options}"$PYTHON" -m trainer.launch --nproc {launch.procs_per_node} '
        f'--device {job.device} --nnodes "$SLURM_NNODES" --rdzv-endpoint "$head:{job.rdzv_port}" '
        f'--rdzv-id "$SLURM_JOB_ID" {args} || status=$?',
        *requeue_lines(launch, job),
        'exit "$status"',
    ]


def requeue_lines(launch: Launch, job: SlurmJob) -> list[str]:
    """After a save on the time limit's signal (exit 75), the job requeues itself to resume."""
    name = shlex.quote(f"protocol run {launch.name}")
    return [
        f'if [ "$status" -eq {SAVED_AND_STOPPED} ]; then',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {job.max_requeues} ]; then',
        f'    echo {name}": saved a checkpoint before the time limit; job $SLURM_JOB_ID requeued to resume from it '
        f'(requeue $((${{SLURM_RESTART_COUNT:-0}} + 1)) of {job.max_requeues})"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  else",
        f'    echo {name}": saved a checkpoint and stopped after {job.max_requeues} requeues (max_requeues); '
        'run protocol run again to resume"',
        "  fi",
        "fi",
    ]


def script_path(out_dir: Path, launch: Launch) -> Path:
    return out_dir / f"{launch.slug}.sbatch"


def slurm_log_pattern(out_dir: Path, launch: Launch) -> Path:
    """The log of a job: SLURM replaces %j with the job id (the folder must exist before submission)."""
    return out_dir / f"{launch.slug}-%j.log"


def job_log(out_dir: Path, launch: Launch, job_id: str) -> Path:
    return out_dir / f"{launch.slug}-{job_id}.log"


def submit_all_script(launches: Sequence[Launch], out_dir: Path) -> str:
    """Submits the seed first; every run that needs it waits for it (afterok), and is cancelled
    by SLURM if the seed fails (--kill-on-invalid-dep, else it would wait forever)."""
    lines = ["#!/usr/bin/env bash", "# Submit the protocol's jobs; runs needing the seed checkpoint wait for it.",
             "set -euo pipefail", 'cd "$(dirname "${BASH_SOURCE[0]}")"']
    seeds = [launch for launch in launches if launch.role == "seed"]
    for launch in seeds:
        lines += [f"seed=$(sbatch --parsable {shlex.quote(script_path(out_dir, launch).name)})",
                  'seed="${seed%%;*}"  # --parsable prints JOBID[;CLUSTER]', 'echo "seed: job $seed"']
    for launch in launches:
        if launch.role == "seed":
            continue
        dependency = "--dependency=afterok:$seed --kill-on-invalid-dep=yes " if seeds and launch.depends_on else ""
        name = shlex.quote(script_path(out_dir, launch).name)
        lines.append(f"echo \"{launch.slug}: job $(sbatch --parsable {dependency}{name})\"")
    return "\n".join(lines) + "\n"


def write_slurm(plan: Plan, launches: Sequence[Launch], out_dir: Path,
                report: Callable[[str], None] | None = None) -> list[Path]:
    """One sbatch script per launch (`<slug>.sbatch`, logs `<slug>-<job id>.log` next to it) and
    `submit_all.sh`; returns their paths, the scripts in launch order, submit_all.sh last. A
    script edited by hand is kept, or refused when the plan's script changed
    (protocol.run.script_files); `report` is told of each one kept."""
    out_dir = Path(out_dir).absolute()
    check_scripts_folder(out_dir)
    texts = {script_path(out_dir, launch): sbatch_script(plan, launch, slurm_log_pattern(out_dir, launch))
             for launch in launches}
    texts[out_dir / SUBMIT_ALL] = submit_all_script(launches, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refused = []
    for path, text in texts.items():
        try:
            note = write_script(path, text)
        except LaunchError as e:
            refused.append(str(e))
            continue
        if note and report is not None:
            report(note)
    if refused:
        raise LaunchError("\n".join(refused))
    return list(texts)
