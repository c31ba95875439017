"""Profiling traces and the W&B run of a real 2-process training run (one launch for both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import TINY_JOB, describe, launch, read_metrics
from tests.unit.test_wandb import offline_runs, read_run

STEPS = 7
PROFILING = ["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "1",
             "--profiling.profiler_active", "1"]
OFFLINE_WANDB = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                 "WANDB_DISABLE_CODE": "true"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    dump_folder = tmp_path_factory.mktemp("observed")
    with pytest.MonkeyPatch.context() as env:
        for name, value in OFFLINE_WANDB.items():
            env.setenv(name, value)
        env.delenv("WANDB_PROJECT", raising=False)
        result = launch(2, [*TINY_JOB, "--training.steps", str(STEPS), "--metrics.enable_wandb", *PROFILING,
                            "--job.dump_folder", str(dump_folder)])
    assert result.returncode == 0, describe(result)
    return dump_folder


def test_every_rank_writes_a_trace_of_each_profile_freq_th_step(run):
    traces = run / "profile_traces"
    written = sorted(str(path.relative_to(traces)) for path in traces.rglob("*.json"))
    assert written == [f"iteration_{step}/rank{rank}_trace.json" for step in (3, 6) for rank in (0, 1)]
    for path in traces.rglob("*.json"):
        events = json.loads(path.read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert sum(name.startswith("ProfilerStep#") for name in names) == 1, path  # one active step
        assert {"aten::mm", "aten::embedding"} <= names, path  # the model's forward ran in it
        assert any(name.startswith("autograd::engine::evaluate_function") for name in names), path  # and backward


@pytest.mark.smoke
def test_the_wandb_run_logs_the_loss_of_metrics_jsonl(run):
    (path,) = offline_runs(run)  # rank 0 only, as TensorBoard
    wandb_run = read_run(path)
    losses = {r["step"]: r["loss"] for r in read_metrics(run) if "kind" not in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert {step: row["loss_metrics/global_avg_loss"] for step, row in wandb_run["history"].items()} == losses
    assert wandb_run["project"] == "llama-pretrain"
    assert wandb_run["config"]["training"]["steps"] == STEPS
    assert wandb_run["config"]["profiling"]["profile_freq"] == 3
    assert wandb_run["exit_code"] == 0
