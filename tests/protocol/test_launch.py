"""Rendering launches, SLURM scripts and submission (fake sbatch/squeue/sacct), and local runs
through a fake launcher that writes what a real run would (no training here)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from protocol.plan.load import load_plan
from protocol.plan.model import REPO_ROOT, RUN_MARKER
from protocol.plan.select import LaunchError
from protocol.run.local import LOG_NAME, run_local
from protocol.run.render import FormatError, render
from protocol.run.sbatch import write_slurm
from protocol.run.slurm import run_slurm
from tests.protocol.conftest import calls
from tests.protocol.fake_trainer import main as fake_main

PLANS = REPO_ROOT / "protocol" / "plans"


def bash_syntax_ok(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------
# Rendering


def test_table_has_aligned_columns_and_each_command_on_its_own_line(small_plan):
    plan = small_plan()
    launches = plan.launches()
    lines = render(plan, launches, "table").splitlines()
    header = lines[0]
    assert header.split() == ["name", "GPUs", "nodes", "degrees", "output"]
    rows = lines[2::2]
    commands = lines[3::2]
    assert len(rows) == len(launches) == 4
    for launch, row, command in zip(launches, rows, commands):
        assert row.startswith(launch.name)
        assert row[header.index("GPUs"):].split()[0] == str(launch.nproc)
        assert row[header.index("output"):] == str(launch.output)
        assert command == f"    {launch.command()}"
    assert "dp_shard 2, tp 2" in rows[2] and "1 process" in rows[0]


def test_json_lists_every_launch(small_plan):
    plan = small_plan()
    launches = plan.launches()
    loaded = json.loads(render(plan, launches, "json"))
    assert [item["name"] for item in loaded] == ["seed", "control", "FSDP+TP2", "lr x2"]
    assert loaded[2]["nproc"] == 4 and loaded[2]["degrees"]["tp"] == 2 and loaded[2]["depends_on"] == ["seed"]
    assert loaded[2]["args"] == list(launches[2].args) and loaded[2]["command"] == launches[2].command()
    assert loaded[2]["output"] == str(launches[2].output)


def test_shell_script_is_valid_bash_claims_each_folder_and_runs_the_seed_first(small_plan, tmp_path):
    plan = small_plan()
    launches = plan.launches()
    text = render(plan, launches, "shell")
    script = tmp_path / "run.sh"
    script.write_text(text)
    bash_syntax_ok(script)
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert f"cd {REPO_ROOT}" in text
    lines = [line.strip() for line in text.splitlines()]
    positions = [lines.index(launch.command()) for launch in launches]
    assert positions == sorted(positions)
    for launch, position in zip(launches, positions):  # each run's folder is claimed right before its command
        assert lines[position - 1].startswith(f"claim {launch.output} ")
    # a seed made already is kept, so the script can run again (the trainer never overwrites a seed)
    assert lines[positions[0] - 5] == f"if [ -f {plan.seed_checkpoint_path / '.metadata'} ]; then"


def test_shell_script_comments_out_runs_needing_several_nodes(tmp_path):
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    launches = plan.launches()
    text = render(plan, launches, "shell")
    script = tmp_path / "run.sh"
    script.write_text(text)
    bash_syntax_ok(script)
    assert f"\n  {launches[0].command()}\n" in text  # the seed runs on this node (unless it exists)
    assert f"\n# {launches[1].command()}\n" in text and "needs 2 nodes" in text


def test_unknown_format(small_plan):
    plan = small_plan()
    with pytest.raises(FormatError, match="choose one of table, json, shell"):
        render(plan, plan.launches(), "yaml")


# ---------------------------------------------------------------------------------------------
# SLURM scripts


def test_slurm_script_of_a_two_node_run(tmp_path):
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    launches = plan.launches()
    paths = write_slurm(plan, launches, tmp_path / "slurm")
    assert [p.name for p in paths] == [f"{l.slug}.sbatch" for l in launches] + ["submit_all.sh"]
    for path in paths:
        bash_syntax_ok(path)
    control = (tmp_path / "slurm" / "1d-fsdp.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --job-name=converging-llama3-8b-1d-fsdp",
                 f"#SBATCH --output={tmp_path / 'slurm' / '1d-fsdp-%j.log'}", "#SBATCH --time=24:00:00",
                 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'):
        assert line in control.splitlines()
    srun = next(line for line in control.splitlines() if line.startswith("srun"))
    assert srun.startswith('srun --kill-on-bad-exit=1 "$PYTHON" -m trainer.launch --nproc 8 --device cuda '
                           '--nnodes "$SLURM_NNODES" --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" '
                           '--job.config_file llama3_8b.toml')
    assert srun.endswith(f"--checkpoint.enable=true --checkpoint.interval 250 --checkpoint.keep_latest_k 1 "
                         f"--checkpoint.last_save_model_only=false --checkpoint.initial_load_path "
                         f"{plan.seed_checkpoint_path} || status=$?")
    assert control.index(f"claim {launches[1].output} ") < control.index("srun --kill")
    big = (tmp_path / "slurm" / "4d-fsdp-tp2-cp2-pp2.sbatch").read_text()
    assert "#SBATCH --nodes=16" in big


def test_the_seed_job_asks_for_memory_and_no_gpu(tmp_path):
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    write_slurm(plan, plan.launches(), tmp_path)
    seed = (tmp_path / "seed.sbatch").read_text().splitlines()
    sbatch = [line for line in seed if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=converging-llama3-8b-seed", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
                      f"#SBATCH --output={tmp_path / 'seed-%j.log'}", "#SBATCH --open-mode=append",
                      "#SBATCH --time=1:00:00", "#SBATCH --mem=64G",
                      "#SBATCH --cpus-per-task=8"]
    assert not any("gpu" in line for line in seed)
    assert any(line.startswith('  srun --ntasks=1 "$PYTHON" -m trainer.launch --nproc 1 --device cpu ')
               for line in seed)


def test_slurm_options_per_kind_of_job(small_plan, tmp_path):
    plan = small_plan()
    text = plan.path.read_text() + ('\n[slurm]\naccount = "proj"\nextra = ["--constraint=h100"]\n'
                                    '[slurm.seed]\npartition = "cpu"\nmem = "16G"\n'
                                    '[slurm.train]\npartition = "gpu"\nqos = "high"\nexclusive = true\n')
    plan.path.write_text(text)
    plan = load_plan(plan.path)
    write_slurm(plan, plan.launches(), tmp_path / "slurm")

    def options(name: str, own: int) -> list[str]:
        lines = (tmp_path / "slurm" / f"{name}.sbatch").read_text().splitlines()
        return [line for line in lines if line.startswith("#SBATCH")][own:]

    assert options("seed", 5) == ["#SBATCH --partition=cpu", "#SBATCH --account=proj", "#SBATCH --mem=16G",
                               "#SBATCH --constraint=h100"]
    assert options("control", 8) == ["#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
                                      "#SBATCH --exclusive", "#SBATCH --constraint=h100"]


def test_submit_all_chains_every_run_after_the_seed(tmp_path):
    plan = load_plan(PLANS / "converging_llama3_8b.toml")
    write_slurm(plan, plan.launches(), tmp_path / "slurm")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/usr/bin/env bash\necho "$*" >> "$SBATCH_LOG"\n'
                      'n=$(wc -l < "$SBATCH_LOG")\necho "$((100 + n));cluster"\n')
    sbatch.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SBATCH_LOG=str(tmp_path / "sbatch.log"))
    done = subprocess.run(["bash", str(tmp_path / "slurm" / "submit_all.sh")], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    submitted = (tmp_path / "sbatch.log").read_text().splitlines()
    assert submitted[0] == "--parsable seed.sbatch"
    assert submitted[1:] == [f"--parsable --dependency=afterok:101 --kill-on-invalid-dep=yes {l.slug}.sbatch"
                             for l in plan.launches()[1:]]
    assert "seed: job 101" in done.stdout


class FakeSlurm:
    """sbatch/squeue/sacct/scancel over a dict of jobs; each poll moves every job one state on.

    A job that finishes writes the files of its run (through the fake trainer), unless its name is
    in `fail`.
    """

    def __init__(self, plan, fail: tuple[str, ...] = ()):
        self.by_script = {f"{l.slug}.sbatch": l for l in plan.launches()}
        self.fail = fail
        self.jobs: dict[str, dict] = {}
        self.commands: list[list[str]] = []

    def __call__(self, argv: list[str]) -> str:
        self.commands.append(argv)
        handler = getattr(self, argv[0])
        return handler(argv)

    def sbatch(self, argv):
        job_id = str(500 + len(self.jobs))
        after = [a.split(":", 1)[1].split(":") for a in argv if a.startswith("--dependency=afterok:")]
        self.jobs[job_id] = {"launch": self.by_script[Path(argv[-1]).name], "state": "PENDING",
                             "after": after[0] if after else []}
        return f"{job_id};main\n"

    def squeue(self, argv):
        self.advance()
        return "".join(f"{i} {j['state']} None\n" for i, j in self.jobs.items() if j["state"] in ("PENDING", "RUNNING"))

    def scontrol(self, argv):
        job = self.jobs[argv[-1]]
        failed = job["state"] == "FAILED"
        return (f"JobId={argv[-1]} JobState={job['state'].split()[0]} Reason={'NonZeroExitCode' if failed else 'None'} "
                f"ExitCode={'1:0' if failed else '0:0'}\n")

    def sacct(self, argv):
        return "".join(f"{i}|{j['state']}\n" for i, j in self.jobs.items())

    def scancel(self, argv):
        self.jobs[argv[1]]["state"] = "CANCELLED by 0"
        return ""

    def advance(self):
        for job in self.jobs.values():
            if job["state"] == "PENDING" and all(self.jobs[a]["state"] == "COMPLETED" for a in job["after"]):
                job["state"] = "RUNNING"
            elif job["state"] == "RUNNING":
                job["state"] = "FAILED" if job["launch"].name in self.fail else "COMPLETED"
                if job["state"] == "COMPLETED":
                    launch = job["launch"]
                    os.environ["NGPU"] = str(launch.nproc)
                    fake_main(list(launch.args))


@pytest.fixture
def fake_slurm_env(fake, monkeypatch):
    monkeypatch.setenv("NGPU", "1")  # FakeSlurm sets it per job, as the job's allocation would


def test_run_slurm_submits_the_seed_first_and_waits(small_plan, tmp_path, fake_slurm_env):
    plan = small_plan()
    fake = FakeSlurm(plan)
    messages: list[str] = []
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=fake, poll=0, on_progress=messages.append,
                        sleep=lambda s: None)
    assert [(r.name, r.status) for r in results] == [("seed", "completed"), ("control", "completed"),
                                                     ("FSDP+TP2", "completed"), ("lr x2", "completed")]
    sbatches = [c for c in fake.commands if c[0] == "sbatch"]
    assert sbatches[0][:2] == ["sbatch", "--parsable"] and not any("--dependency" in a for a in sbatches[0])
    assert all("--dependency=afterok:500" in c for c in sbatches[1:])
    assert [Path(c[-1]).name for c in sbatches] == ["seed.sbatch", "control.sbatch", "fsdp-tp2.sbatch",
                                                     "lr-x2.sbatch"]
    assert all((l.output / RUN_MARKER).is_file() for l in plan.launches())
    assert "seed: submitted as job 500" in messages and "control: submitted as job 501 (after job 500)" in messages
    # A second call has nothing to submit.
    again = FakeSlurm(plan)
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=again, poll=0, sleep=lambda s: None)
    assert {r.status for r in results} == {"already complete"} and again.commands == []


def test_run_slurm_cancels_runs_waiting_on_a_failed_seed(small_plan, tmp_path, fake_slurm_env):
    plan = small_plan()
    fake = FakeSlurm(plan, fail=("seed",))
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "seed-500.log").write_text("loading\nerror: out of host memory\nfull logs: /x\n")
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=fake, poll=0, sleep=lambda s: None)
    assert [(r.name, r.status) for r in results] == [("seed", "failed"), ("control", "skipped"),
                                                     ("FSDP+TP2", "skipped"), ("lr x2", "skipped")]
    assert results[0].message == ("job 500 FAILED (exit code 1:0, reason NonZeroExitCode); error: out of host memory; "
                                  f"log: {tmp_path / 'slurm' / 'seed-500.log'}")
    assert results[0].details == "error: out of host memory\nfull logs: /x"
    assert sorted(c[1] for c in fake.commands if c[0] == "scancel") == ["501", "502", "503"]


# ---------------------------------------------------------------------------------------------
# Local runs


def test_run_local_runs_everything_in_order_then_reuses_what_completed(small_plan, fake, tmp_path):
    plan = small_plan()
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [(r.name, r.status, r.returncode) for r in results] == [
        ("seed", "completed", 0), ("control", "completed", 0), ("FSDP+TP2", "completed", 0),
        ("lr x2", "completed", 0)]
    assert [(c["run"], c["ngpu"]) for c in calls(tmp_path)][1:] == [("control", "2"), ("fsdp-tp2", "4"),
                                                                     ("lr-x2", "2")]
    assert calls(tmp_path)[0]["cwd"] == str(REPO_ROOT)
    assert any(m.startswith("[2/4] control: running 2 processes ...") for m in messages)
    assert any(m.startswith("[2/4] control: done in ") and m.endswith(" s") for m in messages)
    control = plan.launches()[1]
    marker = json.loads((control.output / RUN_MARKER).read_text())
    assert (marker["plan"], marker["run"], marker["command"]) == ("small", "control", control.command())
    assert "finished control" in (control.output / LOG_NAME).read_text()

    messages.clear()
    again = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [r.status for r in again] == ["already complete"] * 4 and all(r.ok for r in again)
    assert len(calls(tmp_path)) == 4
    assert "[1/4] seed: already complete, skipped" in messages


def test_a_failed_run_shows_the_launchers_error_block_and_the_others_still_run(small_plan, fake, tmp_path,
                                                                             monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_FAIL", "fsdp-tp2")
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [(r.name, r.status) for r in results] == [("seed", "completed"), ("control", "completed"),
                                                     ("FSDP+TP2", "failed"), ("lr x2", "completed")]
    failed = results[2]
    block = ("error: rank 1: the run broke: tensor_parallel_degree=3 does not divide 4 heads\n  (a second line)\n"
             f"full logs: {plan.output / 'fsdp-tp2'}/logs")
    assert (failed.returncode, failed.message, failed.details) == (2, "exit 2", block)
    assert failed.log == plan.output / "fsdp-tp2" / LOG_NAME
    report = next(m for m in messages if m.startswith("[3/4]") and "FAILED" in m)
    assert report == f"[3/4] FSDP+TP2: FAILED (exit 2), log: {failed.log}, error:\n" + "\n".join(
        f"    {line}" for line in block.splitlines())
    summary = next(m for m in messages if m.startswith("FSDP+TP2: FAILED"))
    assert summary.endswith("\n    error: rank 1: the run broke: tensor_parallel_degree=3 does not divide 4 heads")

    # Fixed, run again: only the failed run starts; its log keeps the first attempt.
    monkeypatch.delenv("FAKE_FAIL")
    results = run_local(plan, plan.launches(), launcher=fake)
    assert [r.status for r in results] == ["already complete", "already complete", "completed", "already complete"]
    log = failed.log.read_text()
    assert "the run broke" in log and "finished fsdp-tp2" in log and log.count("=== ") == 2


def test_without_an_error_block_the_summary_is_the_last_lines(small_plan, fake, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_NOISE", "control")
    results = run_local(plan, plan.launches(), only=["control"], launcher=fake)
    lines = results[1].details.splitlines()
    assert len(lines) == 15 and lines[-1].startswith("traceback : To enable traceback")
    assert lines[0] == "boilerplate line 17"


def test_a_seed_killed_by_sigkill_names_the_signal_and_the_memory_it_needs(small_plan, fake, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_KILL", "seed")
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [r.status for r in results] == ["failed", "skipped", "skipped", "skipped"]
    assert results[0].returncode == -9
    assert results[0].message == (
        "killed by SIGKILL (exit -9): usually the kernel's out-of-memory killer (see dmesg or the node's kernel "
        "log); the seed run holds the whole tiny model in fp32 in one process: 229,952 parameters x 4 bytes = "
        "0.9 MB of host memory, plus what Python and torch take")
    assert results[0].details == "starting seed"


def test_exit_codes_of_signals():
    from protocol.run.failures import exit_problem, signal_name

    control = load_plan(PLANS / "cpu_smoke.toml").launches()[1]
    assert [signal_name(code) for code in (-9, 137, 143, 130, 2, 1, 0, 128, 255)] == [
        "SIGKILL", "SIGKILL", "SIGTERM", "SIGINT", None, None, None, None, None]
    assert exit_problem(137, control) == ("killed by SIGKILL (exit 137): usually the kernel's out-of-memory killer "
                                          "(see dmesg or the node's kernel log)")
    assert exit_problem(-15, control).startswith("killed by SIGTERM (exit -15): ended from outside")
    assert exit_problem(3, control) == "exit 3"


def test_the_seed_of_the_8b_plan_needs_32_gb():
    from protocol.run.failures import seed_memory

    seed = load_plan(PLANS / "converging_llama3_8b.toml").launches()[0]
    assert "8,030,261,248 parameters x 4 bytes = 32.1 GB of host memory" in seed_memory(seed)


def test_a_failed_seed_skips_the_runs_that_need_it(small_plan, fake, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_FAIL", "seed")
    results = run_local(plan, plan.launches(), launcher=fake)
    assert [r.status for r in results] == ["failed", "skipped", "skipped", "skipped"]
    assert results[1].message == "needs seed, which did not complete"


def test_exit_0_without_every_step_is_a_failure(small_plan, fake, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_SHORT", "control")
    results = run_local(plan, plan.launches(), launcher=fake)
    assert results[1].status == "failed" and results[1].returncode == 0
    assert results[1].message == "the run's record says 'running' at step 2 of 3"


def test_only_runs_the_named_runs_and_the_seed_they_need(small_plan, fake, tmp_path):
    plan = small_plan()
    results = run_local(plan, plan.launches(), only=["lr x2"], launcher=fake)
    assert [r.name for r in results] == ["seed", "lr x2"]
    assert [c["run"] for c in calls(tmp_path)] == ["seed", "lr-x2"]
    results = run_local(plan, plan.launches(), only=["fsdp-tp2"], launcher=fake)  # slugs work too
    assert [(r.name, r.status) for r in results] == [("seed", "already complete"), ("FSDP+TP2", "completed")]


def test_only_with_an_unknown_name_lists_the_valid_ones(small_plan, fake, tmp_path):
    plan = small_plan()
    with pytest.raises(LaunchError) as info:
        run_local(plan, plan.launches(), only=["lrx2"], launcher=fake)
    assert str(info.value) == ("unknown run name(s) 'lrx2'; the plan's runs are: 'seed', 'control', 'FSDP+TP2', "
                               "'lr x2'")
    assert calls(tmp_path) == []


def test_a_folder_the_protocol_did_not_create_is_never_written_to(small_plan, fake, tmp_path):
    plan = small_plan()
    mine = plan.output / "control"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    with pytest.raises(LaunchError, match=f"{mine} exists and was not made by the protocol"):
        run_local(plan, plan.launches(), launcher=fake)
    assert calls(tmp_path) == [] and not (plan.output / "seed").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "my notes"


def test_a_folder_of_another_plan_is_refused(small_plan, fake, tmp_path):
    plan = small_plan()
    folder = plan.output / "seed"
    folder.mkdir(parents=True)
    (folder / RUN_MARKER).write_text(json.dumps({"plan": "other", "run": "seed"}))
    with pytest.raises(LaunchError, match="belongs to run 'seed' of plan 'other'"):
        run_local(plan, plan.launches(), launcher=fake)


def test_runs_spanning_several_nodes_are_not_run_locally(small_plan, fake, tmp_path):
    plan = small_plan(gpus_per_node=2)
    with pytest.raises(LaunchError, match=r"runs needing several nodes cannot run locally: 'FSDP\+TP2' \(2 nodes\)"):
        run_local(plan, plan.launches(), launcher=fake)
    results = run_local(plan, plan.launches(), only=["control"], launcher=fake)
    assert [r.status for r in results] == ["completed", "completed"]


class QueueWithReasons(FakeSlurm):
    """The control's job never starts (a partition limit), and the set's is preempted and requeued
    once by SLURM before it completes. No accounting: squeue alone tells the states."""

    def sacct(self, argv):
        raise LaunchError("sacct failed (exit 1): Slurm accounting storage is disabled")

    def squeue(self, argv):
        self.advance()
        lines = []
        for job_id, job in self.jobs.items():
            name = job["launch"].name
            if name == "control" and job["state"] == "RUNNING":
                job["state"] = "PENDING"  # it never leaves the queue
            if name == "FSDP+TP2" and job["state"] == "RUNNING" and not job.get("preempted"):
                job["state"], job["preempted"] = "PREEMPTED", True
                lines.append(f"{job_id} PREEMPTED None\n")
                job["state"] = "PENDING"  # requeued: it runs again at the next look
                continue
            if job["state"] in ("PENDING", "RUNNING"):
                reason = "PartitionTimeLimit" if name == "control" and job["state"] == "PENDING" else "None"
                lines.append(f"{job_id} {job['state']} {reason}\n")
        return "".join(lines)


def test_a_job_that_cannot_start_is_cancelled_and_a_requeued_one_is_waited_for(small_plan, tmp_path,
                                                                                fake_slurm_env):
    plan = small_plan()
    fake = QueueWithReasons(plan)
    messages: list[str] = []
    results = {r.name: r for r in run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=fake, poll=0,
                                            on_progress=messages.append, sleep=lambda s: None)}
    control = results["control"]
    assert control.status == "failed" and control.message.startswith(
        "job 501 cannot start: pending with reason PartitionTimeLimit; fix the plan's [slurm] options")
    assert ["scancel", "501"] in fake.commands
    assert results["FSDP+TP2"].status == "completed"  # PREEMPTED, then requeued by SLURM: not an end
    assert "FSDP+TP2: job 502 PREEMPTED" in messages
