"""float16 compute with dynamic loss scaling (trainer/loss_scale.py).

Without a loss scale, the gradients of a loss divided by the global token count underflow in
float16: at 8,192 tokens and a 256-token vocabulary, about 1 in 20 gradients of the tiny model
is exactly zero and the gradient is off by ~1%; scaled, none is zero and the error is float16
rounding. Overflows skip the step on every rank, halve the scale, and the scale is checkpointed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, TINY_JOB, describe, launch, read_metrics, run_many

BATCH = ["--training.seq_len", "256", "--training.local_batch_size", "32"]  # 8,192 tokens


def gradients(tmp_path, runs: dict[str, tuple[list[str], bool]]) -> dict[str, torch.Tensor]:
    """name -> one step's gradients of a run of these overrides (and unscaled or not), the runs one
    after the other in one process (tests/workers/fp16_gradients.py)."""
    spec = [{"out": str(tmp_path / f"{name}.pt"), "unscaled": unscaled,
             "overrides": [*TINY_JOB, *BATCH, "--job.dump_folder", str(tmp_path / name), *args]}
            for name, (args, unscaled) in runs.items()]
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "tests.workers.fp16_gradients", "--runs",
                             str(tmp_path / "runs.json")], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=240)
    assert result.returncode == 0, describe(result)
    return {name: torch.load(tmp_path / f"{name}.pt") for name in runs}


def test_float16_gradients_do_not_flush_to_zero(tmp_path):
    fp16 = ["--training.mixed_precision_param", "float16"]
    found = gradients(tmp_path, {"fp32": (["--training.mixed_precision_param", "float32"], False),
                                 "fp16": (fp16, False), "fp16_unscaled": (fp16, True)})
    reference, scaled, unscaled = found["fp32"], found["fp16"], found["fp16_unscaled"]

    def error(g):
        return ((g - reference).norm() / reference.norm()).item(), (g == 0).float().mean().item()

    (scaled_error, scaled_zeros), (unscaled_error, unscaled_zeros) = error(scaled), error(unscaled)
    print(f"relative error / zero fraction: scaled {scaled_error:.2e} / {scaled_zeros:.2e}, "
          f"unscaled {unscaled_error:.2e} / {unscaled_zeros:.2e}")
    assert (reference == 0).sum() == 0
    assert unscaled_zeros > 0.02 and unscaled_error > 5e-3  # what loss scaling is for
    assert scaled_zeros == 0.0
    assert scaled_error < 1.5e-3  # float16 rounding (measured 5e-4)


OVERFLOWING = [  # 512 tokens a step: some gradient overflows float16 from a scale of 2^22 (measured)
    *TINY_JOB, "--training.steps", "8", "--training.seq_len", "64", "--training.local_batch_size", "8",
    "--training.mixed_precision_param", "float16", "--training.loss_scale_initial", str(2 ** 26),
    "--training.loss_scale_growth_interval", "2", "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_microbatch_size", "4",
]
SAVING = ["--checkpoint.enable", "--checkpoint.interval", "4"]
COMPARED = ("loss", "grad_norm", "loss_scale", "skipped_steps", "step_skipped")


TP_FLOAT16 = [*TINY_JOB, "--training.steps", "8", "--training.seq_len", "64", "--training.local_batch_size", "8",
              "--training.mixed_precision_param", "float16", "--training.loss_scale_initial", str(2 ** 24),
              "--training.loss_scale_growth_interval", "2", "--parallelism.tensor_parallel_degree", "2"]


def training_records(dump) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump) if "kind" not in r}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict[str, Path]:
    """The 2-process runs from scratch, one after the other in one process group
    (tests/workers/run_many.py): name -> its dump folder."""
    found, _ = run_many(2, [], {"plain": OVERFLOWING, "saving": [*OVERFLOWING, *SAVING], "TP2": TP_FLOAT16},
                        tmp_path_factory.mktemp("float16-runs"))
    return {name: Path(result["dump"]) for name, result in found.items()}


def test_overflows_skip_steps_and_the_scale_resumes(tmp_path, two_process_runs):
    """PP2 in float16 from a scale of 2^26: steps 1-5 overflow on both stages (the norm is
    global), so the step-4 checkpoint is saved before the optimizer ever stepped. Neither saving
    it nor resuming from it changes a step: the run without checkpoints, the run that saves and
    the resumed run log the same steps 5-8, scale included."""
    records = training_records(two_process_runs["plain"])
    scales = [records[s]["loss_scale"] for s in range(1, 9)]
    skipped = [s for s in range(1, 9) if records[s]["step_skipped"]]
    print(f"loss scale after steps 1-8: {scales}; skipped steps {skipped}")
    assert skipped[:5] == [1, 2, 3, 4, 5] and records[8]["skipped_steps"] == len(skipped)
    assert all(records[s]["grad_norm"] is None for s in skipped)
    assert scales[:5] == [2 ** 25, 2 ** 24, 2 ** 23, 2 ** 22, 2 ** 21]  # halved after each overflow
    assert 2 ** 22 in scales[5:]  # doubled after 2 steps without one
    assert len(skipped) < 8 and all(records[s]["grad_norm"] > 0 for s in range(1, 9) if s not in skipped)

    saving = two_process_runs["saving"]
    resumed = tmp_path / "resumed"
    shutil.copytree(saving / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    result = launch(2, [*OVERFLOWING, *SAVING, "--job.dump_folder", str(resumed)])
    assert result.returncode == 0, describe(result)
    for run in (saving, resumed):
        again = training_records(run)
        for step in range(5, 9):
            assert {k: again[step][k] for k in COMPARED} == {k: records[step][k] for k in COMPARED}, (run.name, step)


def test_tensor_parallel_float16_trains_through_overflows(two_process_runs):
    """TP2 with loss parallelism in float16: the vocabulary-sharded loss is scaled like any other."""
    records = training_records(two_process_runs["TP2"])
    skipped = [s for s in range(1, 9) if records[s]["step_skipped"]]
    print(f"TP2 float16: skipped steps {skipped}, loss scale at step 8 {records[8]['loss_scale']:g}")
    assert skipped[:2] == [1, 2] and len(skipped) < 8
    assert records[8]["loss"] < records[1]["loss"]
