"""SLURM scripts of a plan: one sbatch script per run and a `submit_all.sh`.

The seed job is one process that needs no GPU (it initializes the model on the CPU) but the
whole model in host memory; every other job starts the trainer's launcher (trainer/launcher.py)
once per node through srun, with a c10d rendezvous on the first node of the allocation. The
launcher checks the configuration first and ends a failed run with one `error:` block. Each script claims its run folder
(`.protocol-run`) before the run starts, so `protocol run` and `protocol compare` recognize the
runs it made. The plan's [slurm] tables add #SBATCH options per kind of job.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from protocol.plan.model import RDZV_PORT, REPO_ROOT, Launch, Plan, slugify
from protocol.run.folders import CLAIM_FUNCTION, claim_command
from protocol.run.render import unless_seed_exists

SUBMIT_ALL = "submit_all.sh"


def sbatch_script(plan: Plan, launch: Launch, log_path: Path) -> str:
    """One job: the seed as a single process, every other run through a c10d rendezvous."""
    return "\n".join([*sbatch_header(plan, launch, log_path), *job_body(plan, launch)]) + "\n"


def sbatch_header(plan: Plan, launch: Launch, log_path: Path) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={slugify(plan.name)}-{launch.slug}", f"#SBATCH --nodes={launch.nodes}"]
    if launch.role == "seed":
        lines.append("#SBATCH --ntasks=1")  # and no GPU: the seed is made on the CPU
    else:
        lines += ["#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={launch.procs_per_node}"]
    lines.append(f"#SBATCH --output={log_path}")
    return lines + [f"#SBATCH {option}" for option in plan.slurm_job(launch).sbatch_options()]


def job_body(plan: Plan, launch: Launch) -> list[str]:
    args = shlex.join(launch.args)
    lines = [
        "set -euo pipefail",
        f"cd {shlex.quote(str(REPO_ROOT))}",
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
        'if [ -z "${PYTHON:-}" ]; then',
        '  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON=python',
        f"  elif [ -x {shlex.quote(sys.executable)} ]; then PYTHON={shlex.quote(sys.executable)}  # what wrote this script",
        '  elif [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"',
        "  else PYTHON=python3; fi",
        "fi",
        CLAIM_FUNCTION,
        claim_command(plan, launch),
        f"echo {shlex.quote(f'protocol run {launch.name}: {launch.nproc} process(es)')} "
        '"on $SLURM_NNODES node(s), job $SLURM_JOB_ID"',
    ]
    if launch.role == "seed":
        seed = [f'srun --ntasks=1 "$PYTHON" -m trainer.launcher --nproc 1 --device cpu {args}']
        return lines + unless_seed_exists(launch, seed, "seed")
    return lines + [
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun --kill-on-bad-exit=1 "$PYTHON" -m trainer.launcher --nproc {launch.procs_per_node} --device cuda '
        f'--nnodes "$SLURM_NNODES" --rdzv-endpoint "$head:{RDZV_PORT}" --rdzv-id "$SLURM_JOB_ID" {args}',
    ]


def script_path(out_dir: Path, launch: Launch) -> Path:
    return out_dir / f"{launch.slug}.sbatch"


def slurm_log_pattern(out_dir: Path, launch: Launch) -> Path:
    """The log of a job: SLURM replaces %j with the job id (the folder must exist before submission)."""
    return out_dir / f"{launch.slug}-%j.log"


def job_log(out_dir: Path, launch: Launch, job_id: str) -> Path:
    return out_dir / f"{launch.slug}-{job_id}.log"


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
    submit = out_dir / SUBMIT_ALL
    submit.write_text(submit_all_script(launches, out_dir))
    submit.chmod(0o755)
    return paths + [submit]
