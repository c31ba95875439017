"""float16 compute with dynamic loss scaling on the device: a training run against the same job in
bfloat16 (the eager_bf16 fixture), and one step's gradients against float32."""

from __future__ import annotations

import torch

from tests.cuda.device import JOB, all_finite, dtype_args, run_module, step_records, train
from tests.launch import TINY_JOB, describe


def test_float16_trains_with_loss_scaling(tmp_path, eager_bf16, figure):
    """float16 compute: the loss is scaled (2^16 at start), no step overflows at this size, and the
    losses follow the bfloat16 run's (both round the same float32 computation; on the CPU they
    differed by 1.9e-4 at step 1 and 2.1e-3 at most)."""
    result = train([*JOB, *dtype_args("float16"), "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    fp16, bf16 = step_records(tmp_path), step_records(eager_bf16)
    assert sorted(fp16) == list(range(1, 11)) and all_finite(r["loss"] for r in fp16.values())
    assert all(r["loss_scale"] >= 1 for r in fp16.values()) and fp16[10]["skipped_steps"] <= 2
    diffs = [abs(fp16[s]["loss"] - bf16[s]["loss"]) for s in range(1, 11)]
    figure(f"float16, loss scale {fp16[10]['loss_scale']:g}, skipped steps {fp16[10]['skipped_steps']}: "
           f"|loss diff| vs bfloat16 step 1 {diffs[0]:.1e}, max over 10 steps {max(diffs):.1e}")
    assert diffs[0] < 0.02 and max(diffs) < 0.05, diffs
    assert fp16[10]["loss"] < fp16[1]["loss"] - 0.4


BATCH = ["--training.seq_len", "256", "--training.local_batch_size", "32"]  # 8,192 tokens


def gradients(tmp_path, name: str, args: list[str]) -> torch.Tensor:
    """One step's gradients of the tiny model as the trainer computes them on the device (the
    worker of tests/integration/test_loss_scaling.py)."""
    out = tmp_path / f"{name}.pt"
    result = run_module("tests.workers.fp16_gradients",
                        [str(out), *TINY_JOB, *BATCH, "--job.dump_folder", str(tmp_path / name), *args])
    assert result.returncode == 0, describe(result)
    return torch.load(out)


def test_float16_gradients_do_not_flush_to_zero(tmp_path, figure):
    """As tests/integration/test_loss_scaling.py on the CPU: without the loss scale about 1 in 20
    gradients of the tiny model underflow to zero in float16; scaled, none does."""
    reference = gradients(tmp_path, "fp32", dtype_args("float32"))
    scaled = gradients(tmp_path, "fp16", dtype_args("float16"))
    unscaled = gradients(tmp_path, "fp16_unscaled", [*dtype_args("float16"), "--unscaled"])

    def error(g):
        return ((g - reference).norm() / reference.norm()).item(), (g == 0).float().mean().item()

    (scaled_error, scaled_zeros), (unscaled_error, unscaled_zeros) = error(scaled), error(unscaled)
    figure(f"float16 gradients, relative error / zero fraction: scaled {scaled_error:.2e} / {scaled_zeros:.2e}, "
           f"unscaled {unscaled_error:.2e} / {unscaled_zeros:.2e}")
    assert (reference == 0).sum() == 0
    assert unscaled_zeros > 0.02 and unscaled_error > 5e-3
    assert scaled_zeros == 0.0
    assert scaled_error < 1.5e-3  # float16 rounding (5e-4 on the CPU)
