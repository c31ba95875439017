"""Rendering launches, SLURM scripts and submission (fake sbatch/squeue/sacct), and local runs
through a fake launcher that writes what a real run would (no training here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.launch import (COMPLETE_MARKER, LOG_NAME, RUN_MARKER, LaunchError, render, run_local, run_slurm,
                             write_slurm)
from protocol.plan import REPO_ROOT, load_plan

PLANS = REPO_ROOT / "protocol" / "plans"

PLAN = """
[plan]
name = "small"
config = "debug_model.toml"
output = "{output}"
steps = 3
local_batch_size = 4
dp_degree = 2
gpus_per_node = {gpus_per_node}
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32 }}

[tolerance]
mode = "exact"

[[sets]]
name = "FSDP+TP2"
kind = "parallelism"
tp = 2

[[sets]]
name = "AC full"
kind = "technique"
overrides = {{ "activation_checkpoint.mode" = "full" }}
"""

FAKE_LAUNCHER = '''
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
dump = Path(args[args.index("--job.dump_folder") + 1])
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps({"run": dump.name, "ngpu": os.environ.get("NGPU"), "cwd": os.getcwd()}) + "\\n")
print("starting", dump.name)
if dump.name in os.environ.get("FAKE_FAIL", "").split(","):
    print("Traceback: the run broke", file=sys.stderr)
    sys.exit(3)
dump.mkdir(parents=True, exist_ok=True)
if "--checkpoint.create_seed_checkpoint" in args:
    step0 = dump / "checkpoint" / "step-0"
    step0.mkdir(parents=True)
    (step0 / ".metadata").write_text("")
    sys.exit(0)
steps = int(args[args.index("--training.steps") + 1])
if dump.name in os.environ.get("FAKE_SHORT", "").split(","):
    steps -= 1
with open(dump / "metrics.jsonl", "w") as f:
    for step in range(1, steps + 1):
        f.write(json.dumps({"step": step, "loss": 5.0 - step * 0.1}) + "\\n")
    f.write(json.dumps({"kind": "validation", "step": 1000}) + "\\n")
print("finished", dump.name)
'''


@pytest.fixture
def small_plan(tmp_path):
    def make(gpus_per_node: int = 8):
        path = tmp_path / f"plan-{gpus_per_node}.toml"
        path.write_text(PLAN.format(output=tmp_path / "out", gpus_per_node=gpus_per_node))
        return load_plan(path)
    return make


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake launcher's command; its calls are read back with calls()."""
    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE_LAUNCHER)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.delenv("FAKE_FAIL", raising=False)
    monkeypatch.delenv("FAKE_SHORT", raising=False)
    return [sys.executable, str(script)]


def calls(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def bash_syntax_ok(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------
# Rendering


def test_table_has_aligned_columns_and_each_command_on_its_own_line(small_plan):
    launches = small_plan().launches()
    lines = render(launches, "table").splitlines()
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
    launches = small_plan().launches()
    loaded = json.loads(render(launches, "json"))
    assert [item["name"] for item in loaded] == ["seed", "control", "FSDP+TP2", "AC full"]
    assert loaded[2]["nproc"] == 4 and loaded[2]["degrees"]["tp"] == 2 and loaded[2]["depends_on"] == ["seed"]
    assert loaded[2]["args"] == list(launches[2].args) and loaded[2]["command"] == launches[2].command()
    assert loaded[2]["output"] == str(launches[2].output)


def test_shell_script_is_valid_bash_and_runs_the_seed_first(small_plan, tmp_path):
    launches = small_plan().launches()
    text = render(launches, "shell")
    script = tmp_path / "run.sh"
    script.write_text(text)
    bash_syntax_ok(script)
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert f"cd {REPO_ROOT}" in text
    positions = [text.index(launch.command()) for launch in launches]
    assert positions == sorted(positions)


def test_shell_script_comments_out_runs_needing_several_nodes(tmp_path):
    launches = load_plan(PLANS / "converging_llama3_8b.toml").launches()
    text = render(launches, "shell")
    script = tmp_path / "run.sh"
    script.write_text(text)
    bash_syntax_ok(script)
    assert f"\n{launches[0].command()}\n" in text  # the seed runs on this node
    assert f"\n# {launches[1].command()}\n" in text and "needs 2 nodes" in text


def test_unknown_format(small_plan):
    with pytest.raises(LaunchError, match="choose one of table, json, shell"):
        render(small_plan().launches(), "yaml")


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
                 f"#SBATCH --output={tmp_path / 'slurm' / '1d-fsdp-%j.log'}",
                 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'):
        assert line in control.splitlines()
    srun = next(line for line in control.splitlines() if line.startswith("srun"))
    assert srun.startswith('srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" '
                           '--nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint "$head:29500" '
                           '--rdzv_id "$SLURM_JOB_ID" -m trainer.train --job.config_file llama3_8b.toml')
    assert srun.endswith("--checkpoint.load_only")
    assert "-m trainer.preflight --nproc 16 --device cuda" in control
    seed = (tmp_path / "slurm" / "seed.sbatch").read_text()
    assert "#SBATCH --nodes=1" in seed and "torch.distributed.run" not in seed
    assert 'srun --ntasks=1 "$PYTHON" -m trainer.train' in seed and "--checkpoint.create_seed_checkpoint" in seed
    big = (tmp_path / "slurm" / "4d-fsdp-tp2-cp2-pp2.sbatch").read_text()
    assert "#SBATCH --nodes=16" in big


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
    assert submitted[1:] == [f"--parsable --dependency=afterok:101 {l.slug}.sbatch" for l in plan.launches()[1:]]
    assert "seed: job 101" in done.stdout


class FakeSlurm:
    """sbatch/squeue/sacct/scancel over a dict of jobs; each poll moves every job one state on.

    A job that finishes writes the files of its run (metrics or the seed checkpoint), unless its
    name is in `fail`.
    """

    def __init__(self, plan, fail: tuple[str, ...] = ()):
        self.by_script = {f"{l.slug}.sbatch": l for l in plan.launches()}
        self.fail = fail
        self.jobs: dict[str, dict] = {}
        self.commands: list[list[str]] = []
        self.steps = plan.steps

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
        return "".join(f"{i} {j['state']}\n" for i, j in self.jobs.items() if j["state"] in ("PENDING", "RUNNING"))

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
                    self.write_outputs(job["launch"])

    def write_outputs(self, launch):
        launch.output.mkdir(parents=True, exist_ok=True)
        if launch.role == "seed":
            launch.seed_checkpoint.mkdir(parents=True)
            (launch.seed_checkpoint / ".metadata").write_text("")
        else:
            lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, self.steps + 1)]
            (launch.output / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_run_slurm_submits_the_seed_first_and_waits(small_plan, tmp_path):
    plan = small_plan()
    fake = FakeSlurm(plan)
    messages: list[str] = []
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=fake, poll=0, on_progress=messages.append,
                        sleep=lambda s: None)
    assert [(r.name, r.status) for r in results] == [("seed", "completed"), ("control", "completed"),
                                                     ("FSDP+TP2", "completed"), ("AC full", "completed")]
    sbatches = [c for c in fake.commands if c[0] == "sbatch"]
    assert sbatches[0][:2] == ["sbatch", "--parsable"] and not any("--dependency" in a for a in sbatches[0])
    assert all("--dependency=afterok:500" in c for c in sbatches[1:])
    assert [Path(c[-1]).name for c in sbatches] == ["seed.sbatch", "control.sbatch", "fsdp-tp2.sbatch",
                                                     "ac-full.sbatch"]
    assert all((l.output / COMPLETE_MARKER).is_file() for l in plan.launches()[1:])
    assert "seed: submitted as job 500" in messages and "control: submitted as job 501 (after job 500)" in messages
    # A second call has nothing to submit.
    again = FakeSlurm(plan)
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=again, poll=0, sleep=lambda s: None)
    assert {r.status for r in results} == {"already complete"} and again.commands == []


def test_run_slurm_cancels_runs_waiting_on_a_failed_seed(small_plan, tmp_path):
    plan = small_plan()
    fake = FakeSlurm(plan, fail=("seed",))
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=fake, poll=0, sleep=lambda s: None)
    assert [(r.name, r.status) for r in results] == [("seed", "failed"), ("control", "skipped"),
                                                     ("FSDP+TP2", "skipped"), ("AC full", "skipped")]
    assert "job 500 FAILED" in results[0].message
    assert sorted(c[1] for c in fake.commands if c[0] == "scancel") == ["501", "502", "503"]


# ---------------------------------------------------------------------------------------------
# Local runs


def test_run_local_runs_everything_in_order_then_skips_what_completed(small_plan, fake, tmp_path):
    plan = small_plan()
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [(r.name, r.status, r.returncode) for r in results] == [
        ("seed", "completed", 0), ("control", "completed", 0), ("FSDP+TP2", "completed", 0),
        ("AC full", "completed", 0)]
    assert [(c["run"], c["ngpu"]) for c in calls(tmp_path)][1:] == [("control", "2"), ("fsdp-tp2", "4"),
                                                                     ("ac-full", "2")]
    assert calls(tmp_path)[0]["cwd"] == str(REPO_ROOT)
    assert any(m.startswith("[2/4] control: running 2 processes ...") for m in messages)
    assert any(m.startswith("[2/4] control: done in ") and m.endswith(" s") for m in messages)
    control = plan.launches()[1]
    assert (control.output / COMPLETE_MARKER).is_file() and (control.output / RUN_MARKER).is_file()
    assert "finished control" in (control.output / LOG_NAME).read_text()

    messages.clear()
    again = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [r.status for r in again] == ["already complete"] * 4 and all(r.ok for r in again)
    assert len(calls(tmp_path)) == 4
    assert "[1/4] seed: already complete, skipped" in messages


def test_a_failed_run_is_reported_with_its_log_and_the_others_still_run(small_plan, fake, tmp_path, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_FAIL", "fsdp-tp2")
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert [(r.name, r.status) for r in results] == [("seed", "completed"), ("control", "completed"),
                                                     ("FSDP+TP2", "failed"), ("AC full", "completed")]
    failed = results[2]
    assert not failed.ok and failed.returncode == 3
    assert failed.log == plan.output / "fsdp-tp2" / LOG_NAME
    assert "Traceback: the run broke" in failed.message
    report = next(m for m in messages if "FAILED" in m and m.startswith("[3/4]"))
    assert report.startswith(f"[3/4] FSDP+TP2: FAILED (exit 3), log: {failed.log}, last lines:")
    assert "Traceback: the run broke" in report
    assert not (plan.output / "fsdp-tp2" / COMPLETE_MARKER).exists()

    # Fixed, run again: only the failed run starts; its log keeps the first attempt.
    monkeypatch.delenv("FAKE_FAIL")
    results = run_local(plan, plan.launches(), launcher=fake)
    assert [r.status for r in results] == ["already complete", "already complete", "completed", "already complete"]
    log = failed.log.read_text()
    assert "the run broke" in log and "finished fsdp-tp2" in log and log.count("=== ") == 2


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
    assert results[1].message.startswith("metrics.jsonl reaches step 2 of 3")


def test_only_runs_the_named_runs_and_the_seed_they_need(small_plan, fake, tmp_path):
    plan = small_plan()
    results = run_local(plan, plan.launches(), only=["AC full"], launcher=fake)
    assert [r.name for r in results] == ["seed", "AC full"]
    assert [c["run"] for c in calls(tmp_path)] == ["seed", "ac-full"]
    results = run_local(plan, plan.launches(), only=["fsdp-tp2"], launcher=fake)  # slugs work too
    assert [(r.name, r.status) for r in results] == [("seed", "already complete"), ("FSDP+TP2", "completed")]


def test_only_with_an_unknown_name_lists_the_valid_ones(small_plan, fake, tmp_path):
    plan = small_plan()
    with pytest.raises(LaunchError) as info:
        run_local(plan, plan.launches(), only=["ACfull"], launcher=fake)
    assert str(info.value) == ("unknown run name(s) 'ACfull'; the plan's runs are: 'seed', 'control', 'FSDP+TP2', "
                               "'AC full'")
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
