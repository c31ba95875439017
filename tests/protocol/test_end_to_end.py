"""The protocol from a plan file to a verdict, with real training runs (gloo on CPU).

Sets of the shipped cpu_smoke plan pass (the whole plan runs in tests/slurm/); a plan whose
technique set is really wrong (a larger learning rate) fails and names the first step where its
loss leaves the tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.plan.model import slugify
from tests.protocol import smoke

ROOT = Path(__file__).resolve().parents[2]
# Real plans, with real training runs.
pytestmark = pytest.mark.slow


def protocol(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "protocol", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


# The local launcher runs the control and cpu_smoke's quickest set; the whole plan, with its 3D, 4D,
# compiled TP and CP sets, runs through a real SLURM controller in tests/slurm/.
LOCAL_SETS = ("AC full",)


def test_cpu_smoke_sets_run_and_pass_and_completed_runs_are_reused(tmp_path, measured):
    only = ",".join(("1D FSDP", *LOCAL_SETS))  # the control, and the seed they need
    result = protocol("run", str(smoke.PLAN), "--only", only, "--compare", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    out = tmp_path / smoke.OUTPUT
    smoke.check_report(out, set(LOCAL_SETS), lambda name: (out / slugify(name) / "protocol.log").read_text(),
                       measured)

    # Completed runs are not repeated; the comparison alone gives the same verdict.
    again = protocol("run", str(smoke.PLAN), "--only", only, cwd=tmp_path)
    assert again.returncode == 0, explain(again)
    assert (again.stdout + again.stderr).count("already complete, skipped") == 3, explain(again)
    compared = protocol("compare", str(smoke.PLAN), "--only", only, cwd=tmp_path)
    assert compared.returncode == 0 and "PASS: every test set" in compared.stdout, explain(compared)


WRONG_PLAN = """
[plan]
name = "wrong_lr"
config = "debug_model.toml"
output = "runs"
steps = 6
warmup_steps = 1
local_batch_size = 2
dp_degree = 2
seed_checkpoint = true

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"optimizer.lr" = 3e-3
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"debug.deterministic" = true

[tolerance]
mode = "exact"
loss_atol = 1e-4

[[sets]]
name = "lr x2"
kind = "technique"
overrides = { "optimizer.lr" = 6e-3 }
"""


def test_a_wrong_technique_fails_at_the_first_diverging_step(tmp_path):
    (tmp_path / "wrong.toml").write_text(WRONG_PLAN)
    result = protocol("run", "wrong.toml", "--compare", cwd=tmp_path)
    assert result.returncode == 1, explain(result)
    assert "FAIL: lr x2" in result.stdout, explain(result)

    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    (wrong,) = report["results"]
    # Step 1's loss comes before any update, so it is equal; the larger step shows from step 2 on.
    assert abs(wrong["initial_loss"] - wrong["control_initial_loss"]) <= 1e-6
    assert wrong["outcome"] == "FAIL" and wrong["first_diverging_step"] == 2
    assert "step 2" in wrong["reason"]
    assert "step 2" in (tmp_path / "runs" / "report.md").read_text()
    assert report["layouts"]["lr x2"] == "dp_shard 2 + optimizer.lr=0.006"  # from the run's own record
    # The fingerprints see it at step 1: the same gradients, every update twice as large.
    where = report["fingerprints"]["lr x2"]
    assert where["first_step"] == 1 and where["causes"][0]["module"] == "every parameter", where["summary"]
    assert where["causes"][0]["quantity"] == "update_norm" and abs(where["causes"][0]["low"] - 1.0) < 0.01

    # The set's option is set back to the control's in the plan: its finished run no longer
    # describes the plan and is refused...
    (tmp_path / "wrong.toml").write_text(WRONG_PLAN.replace('"optimizer.lr" = 6e-3', '"optimizer.lr" = 3e-3'))
    refused = protocol("run", "wrong.toml", "--compare", cwd=tmp_path)
    assert refused.returncode == 2, explain(refused)
    assert "lr x2: optimizer.lr 0.006 -> 0.003" in refused.stderr and "--rerun-stale" in refused.stderr
    # ... and run again with the flag (alone: the seed and the control are current), after which it passes.
    rerun = protocol("run", "wrong.toml", "--rerun-stale", "--compare", cwd=tmp_path)
    assert rerun.returncode == 0, explain(rerun)
    assert (rerun.stdout + rerun.stderr).count("already complete, skipped") == 2, explain(rerun)
    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    assert report["layouts"]["lr x2"] == "dp_shard 2" and report["passed"] is True
    (moved,) = (tmp_path / "runs" / "superseded").iterdir()
    assert json.loads((moved / "run_meta.json").read_text())["config"]["optimizer"]["lr"] == 0.006


SYNC_SWEEP_PLAN = """
[plan]
name = "sync_sweep"
config = "debug_model.toml"
output = "{output}"
steps = 20
warmup_steps = 2
local_batch_size = 4
dp_degree = 1
seed_checkpoint = true

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"optimizer.lr" = 3e-3
"metrics.log_freq" = 5
"metrics.enable_tensorboard" = false
"metrics.count_collectives" = true
"validation.enable" = true
"validation.freq" = 10
"debug.deterministic" = true

[tolerance]
mode = "exact"

[criterion]
metric = "validation/loss"
max_vs_control = 1.02

[[sweeps]]
name = "sync"
kind = "technique"
tp = 2
search = "bisect"
points = [
  { name = "full", "parallelism.tensor_parallel_sync" = "full" },
  { name = "per_block", "parallelism.tensor_parallel_sync" = "per_block" },
  { name = "grouped 2", "parallelism.tensor_parallel_sync" = "grouped", "parallelism.tensor_parallel_sync_group" = 2 },
]
"""


def test_a_sync_sweep_bisects_with_real_runs_and_reports_measured_syncs(tmp_path):
    """One command from a searched sweep of tensor_parallel_sync to the table, PNG and answer: the
    bisection over 3 points that all meet the criterion runs the middle one and the last, and the
    table's syncs per forward are the trainer's counts (2 x 4 blocks + 1, 4 + 1, 2 + 1)."""
    plan = tmp_path / "plan.toml"
    plan.write_text(SYNC_SWEEP_PLAN.replace("{output}", str(tmp_path / "out")))
    result = protocol("run", str(plan), "--compare", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert "sync: fewest syncs meeting the criterion: 3 (sync grouped 2)" in result.stdout
    report = json.loads((tmp_path / "out" / "sweep_report.json").read_text())
    [table] = report["sweeps"]
    rows = {row["name"]: row for row in table["rows"]}
    assert rows["sync per_block"]["syncs"] == 5 and rows["sync grouped 2"]["syncs"] == 3
    assert rows["sync full"]["meets"] == "not needed" and not (tmp_path / "out" / "sync-full").exists()
    assert rows["sync grouped 2"]["meets"] == "yes" and rows["sync grouped 2"]["step_time"] > 0
    assert (tmp_path / "out" / "sweep-sync.png").stat().st_size > 10_000
