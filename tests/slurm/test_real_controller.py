"""The protocol on a real SLURM controller: a one-machine cluster (tests/slurm/conftest.py) runs
the shipped cpu_smoke plan to a PASS report through `protocol run --launcher slurm`, cancels what
waits on a cancelled seed job, reports a failed job's reason and log, and a training job cut by
its time limit saves, requeues itself and resumes onto the uninterrupted curve.

What this cluster cannot show: a rendezvous across machines, NCCL, GPUs (docs/protocol_running.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.plan.model import slugify
from tests.launch import curve, read_metrics
from tests.protocol import smoke

ROOT = Path(__file__).resolve().parents[2]
# One chain with the compile matrix (tests/machine_share.py): the smoke's compiled set loads what it
# compiled, though only the smoke is big.
pytestmark = pytest.mark.chain


def environment(conf: Path, **extra: str) -> dict[str, str]:
    """What `protocol` and the jobs it submits see (sbatch passes the environment on: the compiled
    set compiles into the test run's cache, tests/conftest.py)."""
    return {**os.environ, "SLURM_CONF": str(conf), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), **extra}


def protocol(conf: Path, cwd: Path, *args: str, timeout: int = 900, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "protocol", *args], cwd=cwd, env=environment(conf, **extra),
                          capture_output=True, text=True, timeout=timeout)


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-5000:]}\n--- stderr\n{result.stderr[-5000:]}"


def slurm(conf: Path, *argv: str) -> str:
    return subprocess.run(list(argv), env={**os.environ, "SLURM_CONF": str(conf)}, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def job_state(conf: Path, job_id: str) -> dict[str, str]:
    text = slurm(conf, "scontrol", "show", "job", "-o", job_id)
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


@pytest.mark.cores(2)  # jobs of up to 16 processes keep both cores busy (tests/machine_share.py)
def test_cpu_smoke_passes_through_a_real_controller(slurm_cluster, tmp_path, measured):
    started = time.monotonic()
    result = protocol(slurm_cluster, tmp_path, "run", str(smoke.PLAN), "--launcher", "slurm", "--poll", "2",
                      "--compare")
    assert result.returncode == 0, explain(result)
    seconds = time.monotonic() - started
    out = tmp_path / smoke.OUTPUT

    def job_log(name: str) -> str:
        (log,) = (out / "slurm").glob(f"{slugify(name)}-*.log")  # one job per run
        return log.read_text()

    smoke.check_report(out, set(smoke.APPLIED), job_log, measured)
    log = result.stdout + result.stderr
    for name in ("seed", "1D FSDP", *smoke.APPLIED):
        assert f"{name}: submitted as job " in log and f"{name}: done" in log, name
    # The 4D set's job asked for a CPU per process and ran its 16 processes on the CPU.
    assert "#SBATCH --cpus-per-task=16" in (out / "slurm" / "4d-fsdp-tp2-cp2-pp2.sbatch").read_text()
    assert "16 processes on cpu" in job_log("4D FSDP+TP2+CP2+PP2")
    measured(f"slurm: cpu_smoke through a one-machine controller in {seconds:.0f} s")

    # Nothing is submitted again (the local launcher's test compares again without running).
    again = protocol(slurm_cluster, tmp_path, "run", str(smoke.PLAN), "--launcher", "slurm", "--poll", "2")
    assert again.returncode == 0 and "submitted" not in again.stdout + again.stderr, explain(again)
    assert (again.stdout + again.stderr).count("already complete, skipped") == 7, explain(again)


SMALL = """
[plan]
name = "{name}"
config = "debug_model.toml"
output = "runs"
steps = {steps}
warmup_steps = 2
local_batch_size = 2
dp_degree = {dp}
seed_checkpoint = {seed}
checkpoint_interval = {interval}

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"optimizer.lr" = 3e-3
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"debug.deterministic" = true
{overrides}
[tolerance]
mode = "exact"

[control]
name = "control"

[[sets]]
name = "AC full"
kind = "technique"
overrides = {{ "activation_checkpoint.mode" = "full" }}
{slurm}
"""


def small_plan(folder: Path, slurm: str, name: str = "small", steps: int = 4, dp: int = 2,
               interval: int = 10, seed: bool = True, overrides: str = "") -> Path:
    """The plan in `folder`: `slurm` its [slurm] tables, `overrides` more lines of [plan.overrides]."""
    path = folder / "plan.toml"
    path.write_text(SMALL.format(name=name, steps=steps, dp=dp, interval=interval, slurm=slurm,
                                 seed=str(seed).lower(), overrides=overrides))
    return path


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.mark.real_processes  # scancel signals the job's processes
def test_cancelling_the_seed_cancels_every_job_waiting_on_it(slurm_cluster, tmp_path):
    """submit_all.sh alone (no protocol process waiting): SLURM cancels the dependants itself
    (--kill-on-invalid-dep), instead of keeping them pending forever; then `protocol run`, with a
    seed job cancelled while it waits, reports every dependant skipped and the report NOT RUN."""
    plan = small_plan(tmp_path, '[slurm]\nprologue = ["sleep 30"]\n[slurm.train]\ndevice = "cpu"\n')
    scripts = tmp_path / "scripts"
    planned = protocol(slurm_cluster, tmp_path, "plan", str(plan), "--format", "slurm", "--out", str(scripts))
    assert planned.returncode == 0, explain(planned)
    submitted = subprocess.run(["bash", str(scripts / "submit_all.sh")], env=environment(slurm_cluster),
                               capture_output=True, text=True, check=True, timeout=60).stdout
    jobs = dict(line.split(": job ") for line in submitted.splitlines())
    slurm(slurm_cluster, "scancel", jobs["seed"])
    for run in ("control", "ac-full"):
        state = wait_for(lambda: (s := job_state(slurm_cluster, jobs[run]))["JobState"] != "PENDING" and s,
                         f"SLURM to cancel {run}", timeout=60)
        assert (state["JobState"], state["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), state

    runner = subprocess.Popen([sys.executable, "-m", "protocol", "run", str(plan), "--launcher", "slurm", "--poll",
                               "1", "--compare"], cwd=tmp_path, env=environment(slurm_cluster),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seed_log = tmp_path / "runs" / "slurm"
    seed_job = wait_for(lambda: next(iter(sorted(seed_log.glob("seed-*.log"))), None), "the seed job to start")
    slurm(slurm_cluster, "scancel", seed_job.stem.split("-")[-1])
    output, _ = runner.communicate(timeout=120)
    assert runner.returncode == 1, output
    assert f"seed: FAILED (job {seed_job.stem.split('-')[-1]} CANCELLED" in output, output
    for run in ("control", "AC full"):
        assert f"{run}: skipped, needs seed, which did not complete" in output, output
    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    assert report["status"] == "FAIL" and report["note"].startswith("nothing to compare against: the control run "
                                                                     "control NOT RUN (needs seed")
    assert [(r["name"], r["verdict"]) for r in report["not_compared"]] == [("control", "NOT RUN"),
                                                                           ("AC full", "NOT RUN")]


@pytest.mark.smoke
def test_a_failed_job_reaches_the_report_with_its_reason_and_log(slurm_cluster, tmp_path):
    failing = ('[slurm.train]\ndevice = "cpu"\n'
               'prologue = ["echo \'error: the site prologue failed (on purpose)\' >&2", "exit 3"]\n')
    plan = small_plan(tmp_path, failing)
    result = protocol(slurm_cluster, tmp_path, "run", str(plan), "--launcher", "slurm", "--poll", "1", "--compare",
                      timeout=300)
    assert result.returncode == 1, explain(result)
    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    log = next((tmp_path / "runs" / "slurm").glob("control-*.log"))
    job = log.stem.split("-")[-1]
    expected = (f"job {job} FAILED (exit code 3:0, reason NonZeroExitCode); error: the site prologue failed "
                f"(on purpose); log: {log}")
    reasons = {r["name"]: (r["verdict"], r["reason"]) for r in report["not_compared"]}
    assert reasons["control"] == ("FAILED", expected), reasons
    assert f"control: FAILED ({expected})" in result.stdout + result.stderr, explain(result)
    assert expected in (tmp_path / "runs" / "report.md").read_text()


@pytest.mark.real_processes  # SLURM signals the job's processes at its time limit
def test_a_job_at_its_time_limit_saves_requeues_itself_and_resumes_onto_the_same_curve(slurm_cluster, tmp_path):
    """One process for about 38 s of training under a 1-minute limit: SLURM signals it 30 s before
    the limit or up to 30 s earlier (its time-limit check runs every 30 s), so within 30 s of the
    job's start; it saves and stops (exit 75), the job requeues itself and resumes from that
    checkpoint, maybe more than once. The job waits 120 ms after each step (debug.step_delay_s), so
    its 38 s cost a core 2 s, not 38. With 80 ms (27 s of training) a start of 3 s on a fast
    machine ended the run at the 30 s mark, before the signal, once in four runs. The same run
    made locally at the same time, uninterrupted and without the wait, is the reference: every
    step's loss and gradient norm are equal."""
    steps, delay = 300, 0.12  # about 38 s with the wait (and 7 ms a step on an idle core) after a start of 3 to 7 s
    # No seed job: both runs initialize the same weights from debug.seed (init is layout-invariant).
    limited = small_plan(tmp_path, '[slurm.train]\ndevice = "cpu"\ntime = "1"\nsave_before_limit = 30\n',
                         name="time_limit", steps=steps, dp=1, interval=100000, seed=False,
                         overrides=f'"debug.step_delay_s" = {delay}\n')
    reference = tmp_path / "reference"
    reference.mkdir()
    small_plan(reference, "", name="time_limit", steps=steps, dp=1, interval=100000, seed=False)
    # One thread each: the two runs share the machine's two cores, and compute the same sums.
    local = subprocess.Popen([sys.executable, "-m", "protocol", "run", "plan.toml", "--only", "control"],
                             cwd=reference, env=environment(slurm_cluster, OMP_NUM_THREADS="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = protocol(slurm_cluster, tmp_path, "run", str(limited), "--launcher", "slurm", "--only", "control",
                      "--poll", "1", timeout=600, OMP_NUM_THREADS="1")
    output, _ = local.communicate(timeout=600)
    assert local.returncode == 0, output
    assert result.returncode == 0, explain(result)

    run = tmp_path / "runs" / "control"
    record = json.loads((run / "run_meta.json").read_text())
    starts = [h["status"] for h in record["history"]]
    assert record["status"] == "completed" and starts and set(starts) == {"interrupted"}, starts
    job_log = next((tmp_path / "runs" / "slurm").glob("control-*.log")).read_text()
    assert job_log.count("requeued to resume from it") == len(starts), job_log[-3000:]
    assert "PENDING" in result.stdout + result.stderr  # the runner saw the job wait again after its requeue

    resumed, uninterrupted = curve(run), curve(reference / "runs" / "control")
    assert [s for s, _, _ in resumed] == list(range(1, steps + 1))
    assert resumed == uninterrupted
    # The wait is not the step's: the steps' own seconds stay under it.
    step_times = sorted(r["step_time_s"] for r in read_metrics(run))
    assert step_times[len(step_times) // 2] < delay, step_times
