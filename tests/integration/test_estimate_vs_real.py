"""The estimator against real runs: the same job on CPU, once for real (tests/workers/step_memory.py
under torchrun, gloo) and once on fake tensors in a fake world (trainer.estimate). What a rank
holds (parameters, gradients, optimizer state) must be equal to the byte; the step peak of the
same tracker over real and fake tensors is recorded (docs/performance.md states the agreement).
Both runs compute in float32, the CPU's precision (the estimator otherwise assumes CUDA's bf16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO
from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.estimate.rank import rank_kinds
from trainer.parallel.dims import stage_plan
from trainer.preflight import plan_run

JOB = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
       "--metrics.no_enable_tensorboard", "--training.mixed_precision_param", "float32"]
TP2, PP2 = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
LAYOUTS = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "FSDP 2 x TP 2": (4, TP2),
    "PP 2 Interleaved1F1B (2 stages per rank)": (2, [*PP2, *INTERLEAVED]),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "FSDP 2 x TP 2 x PP 2, AC full": (8, [*TP2, *PP2, *INTERLEAVED, "--activation_checkpoint.mode", "full"]),
    "FSDP 2 x TP 2 x PP 2, AC selective": (8, [*TP2, *PP2, *INTERLEAVED, "--activation_checkpoint.mode", "selective"]),
}


def real_run(nproc: int, args: list[str], tmp_path) -> dict[int, dict]:
    out = tmp_path / "figures"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "tests.workers.step_memory", str(out), *args, "--job.dump_folder", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(f.stem.removeprefix("rank")): json.loads(f.read_text()) for f in out.glob("rank*.json")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimated_state_bytes_equal_the_real_run(layout, tmp_path, measured):
    nproc, args = LAYOUTS[layout]
    overrides = [*JOB, *args]
    real = real_run(nproc, overrides, tmp_path)
    config, _ = estimated_config(overrides)
    plan = plan_run(config, nproc)
    kinds = rank_kinds(plan.dims, stage_plan(config, plan.dims))
    assert len(real) == nproc
    for estimate in estimate_kinds(overrides, nproc, kinds, steps=1):
        ranks = real[estimate.kind.rank]
        assert (estimate.state.parameters, estimate.state.gradients, estimate.state.optimizer) == \
            (ranks["parameters"], ranks["gradients"], ranks["optimizer"]), estimate.kind
        real_peak = ranks["step_peak"]["total"]
        measured(f"estimate vs real, {layout:42s} {estimate.kind.name:24s}: state {estimate.state.total} B equal; "
                 f"step peak {estimate.step_peak.total} B estimated, {real_peak} B real "
                 f"({100 * (estimate.step_peak.total / real_peak - 1):+.1f}%)")
