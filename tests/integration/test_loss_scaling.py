"""float16 compute with dynamic loss scaling (trainer/loss_scale.py).

Without a loss scale, the gradients of a loss divided by the global token count underflow in
float16: at 8,192 tokens and a 256-token vocabulary, about 1 in 20 gradients of the tiny model
is exactly zero and the gradient is off by ~1%; scaled, none is zero and the error is float16
rounding. Overflows skip the step on every rank, halve the scale, and the scale is checkpointed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from tests.launch import REPO, TINY_JOB, describe, launch, read_metrics

BATCH = ["--training.seq_len", "256", "--training.local_batch_size", "32"]  # 8,192 tokens


def gradients(tmp_path, name: str, args: list[str]) -> torch.Tensor:
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "tests.workers.fp16_gradients", str(out), *TINY_JOB, *BATCH,
                             "--job.dump_folder", str(tmp_path / name), *args],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert result.returncode == 0, describe(result)
    return torch.load(out)


def test_float16_gradients_do_not_flush_to_zero(tmp_path):
    reference = gradients(tmp_path, "fp32", ["--training.mixed_precision_param", "float32"])
    fp16 = ["--training.mixed_precision_param", "float16"]
    scaled = gradients(tmp_path, "fp16", fp16)
    unscaled = gradients(tmp_path, "fp16_unscaled", [*fp16, "--unscaled"])

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


def training_records(dump) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump) if "kind" not in r}


def test_overflows_skip_steps_and_the_scale_resumes(tmp_path):
    """PP2 in float16 from a scale of 2^26: steps 1-5 overflow on both stages (the norm is
    global), so the step-4 checkpoint is saved before the optimizer ever stepped. Neither saving
    it nor resuming from it changes a step: the run without checkpoints, the run that saves and
    the resumed run log the same steps 5-8, scale included."""
    plain = tmp_path / "plain"
    result = launch(2, [*OVERFLOWING, "--job.dump_folder", str(plain)])
    assert result.returncode == 0, describe(result)
    records = training_records(plain)
    scales = [records[s]["loss_scale"] for s in range(1, 9)]
    skipped = [s for s in range(1, 9) if records[s]["step_skipped"]]
    print(f"loss scale after steps 1-8: {scales}; skipped steps {skipped}")
    assert skipped[:5] == [1, 2, 3, 4, 5] and records[8]["skipped_steps"] == len(skipped)
    assert all(records[s]["grad_norm"] is None for s in skipped)
    assert scales[:5] == [2 ** 25, 2 ** 24, 2 ** 23, 2 ** 22, 2 ** 21]  # halved after each overflow
    assert 2 ** 22 in scales[5:]  # doubled after 2 steps without one
    assert len(skipped) < 8 and all(records[s]["grad_norm"] > 0 for s in range(1, 9) if s not in skipped)

    saving = tmp_path / "saving"
    result = launch(2, [*OVERFLOWING, *SAVING, "--job.dump_folder", str(saving)])
    assert result.returncode == 0, describe(result)
    resumed = tmp_path / "resumed"
    shutil.copytree(saving / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    result = launch(2, [*OVERFLOWING, *SAVING, "--job.dump_folder", str(resumed)])
    assert result.returncode == 0, describe(result)
    for run in (saving, resumed):
        again = training_records(run)
        for step in range(5, 9):
            assert {k: again[step][k] for k in COMPARED} == {k: records[step][k] for k in COMPARED}, (run.name, step)


def test_tensor_parallel_float16_trains_through_overflows(tmp_path):
    """TP2 with loss parallelism in float16: the vocabulary-sharded loss is scaled like any other."""
    result = launch(2, [*TINY_JOB, "--training.steps", "8", "--training.seq_len", "64", "--training.local_batch_size",
                        "8", "--training.mixed_precision_param", "float16", "--training.loss_scale_initial",
                        str(2 ** 24), "--training.loss_scale_growth_interval", "2",
                        "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    records = training_records(tmp_path)
    skipped = [s for s in range(1, 9) if records[s]["step_skipped"]]
    print(f"TP2 float16: skipped steps {skipped}, loss scale at step 8 {records[8]['loss_scale']:g}")
    assert skipped[:2] == [1, 2] and len(skipped) < 8
    assert records[8]["loss"] < records[1]["loss"]
