"""The debug model trains on the device in float32 and bfloat16, and a checkpointed run resumes
exactly (deterministic mode), one process."""

from __future__ import annotations

import pytest

from tests.cuda.device import (DETERMINISTIC, DEVICE, JOB, all_finite, dtype_args, losses, median_speed, peak_gib,
                               run_record, step_records, train)
from tests.launch import describe
from trainer.metrics.step_log import PEAK_BF16_DENSE_FLOPS

# What `parallelize` reports for one process: no FSDP in either dtype; in bfloat16 the model casts
# its float32 weights itself (ModelRuntime.compute_dtype).
LAYOUT = {"float32": "none (one process: the model runs unwrapped)",
          "bfloat16": "none (one process: the model runs unwrapped, computing in bfloat16)"}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def straight(request, tmp_path_factory):
    """10 steps without a pause, deterministic: (dtype, dump folder, launcher result)."""
    dtype = request.param
    dump = tmp_path_factory.mktemp(f"straight-{dtype}")
    result = train([*JOB, *DETERMINISTIC, *dtype_args(dtype), "--job.dump_folder", str(dump)])
    return dtype, dump, result


def test_debug_model_trains_on_the_device(straight, figure):
    dtype, dump, result = straight
    assert result.returncode == 0, describe(result)
    assert f"1 process on {DEVICE}" in result.stdout
    assert LAYOUT[dtype] in result.stdout
    record = run_record(dump)
    assert record["status"] == "completed"
    assert record["device"] == ("cuda:0" if DEVICE == "cuda" else "cpu")
    steps = step_records(dump)
    assert sorted(steps) == list(range(1, 11))
    loss = [steps[s]["loss"] for s in range(1, 11)]
    assert all_finite(loss) and all_finite(steps[s]["grad_norm"] for s in steps)
    # Measured on the CPU: 8.1650 -> 7.3080 in float32 (the warmup reaches 3e-3 at step 10).
    assert 7.9 < loss[0] < 8.3 and loss[-1] < loss[0] - 0.4, loss
    last = steps[10]
    if DEVICE == "cuda":
        assert last["memory"]["max_allocated_gib"] > 0
        known = any(key.upper() in record["device_name"].upper() for key in PEAK_BF16_DENSE_FLOPS)
        assert (last["mfu"] is not None) == known, (record["device_name"], last["mfu"])
    else:
        assert "peak_rss_gib" in last["memory"] and last["mfu"] is None
    tokens_per_s, ms_per_step = median_speed(steps)
    figure(f"debug model {dtype}, batch 8 x 128, deterministic, 10 steps on {record['device_name']}: loss "
           f"{loss[0]:.4f} -> {loss[-1]:.4f}; median of steps 2-10 {tokens_per_s:,.0f} tokens/s, {ms_per_step:.1f} "
           f"ms/step; peak {peak_gib(last['memory']):.2f} GiB")


def test_a_checkpointed_run_resumes_exactly(straight, tmp_path, figure):
    """Stop after step 5 with a checkpoint, raise training.steps to 10: steps 6-10 are those of the
    run that never stopped, bit for bit (model, optimizer, scheduler, data position restored)."""
    dtype, uninterrupted, result = straight
    assert result.returncode == 0, describe(result)
    args = [*JOB, *DETERMINISTIC, *dtype_args(dtype), "--checkpoint.enable", "--job.dump_folder", str(tmp_path)]
    first = train([*args, "--training.steps", "5"])
    assert first.returncode == 0, describe(first)
    assert (tmp_path / "checkpoint" / "step-5").is_dir()
    resumed = train(args)
    assert resumed.returncode == 0, describe(resumed)
    assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in resumed.stdout
    assert "(step 5)" in resumed.stdout
    again, reference = step_records(tmp_path), step_records(uninterrupted)
    assert sorted(again) == list(range(1, 11))
    diffs = {s: abs(again[s]["loss"] - reference[s]["loss"]) for s in range(1, 11)}
    figure(f"resume at step 5, {dtype}: largest |loss diff| over steps 6-10 {max(diffs[s] for s in range(6, 11)):.1e}")
    assert losses(tmp_path) == losses(uninterrupted), diffs
    assert [again[s]["grad_norm"] for s in range(6, 11)] == [reference[s]["grad_norm"] for s in range(6, 11)]


@pytest.mark.parametrize("offload", [False, True], ids=["on the device", "cpu offload"])
def test_fingerprints_on_the_device_add_up_to_the_logged_norm(tmp_path, figure, offload):
    """metrics.fingerprints on the device: steps 1-3 recorded, every figure finite, and the
    parameters' gradient norms add up to the global norm the run logged; with the parameters
    offloaded to the CPU (FSDP over one rank) too, where their sums are taken on the CPU."""
    import json
    import math

    if offload and DEVICE != "cuda":
        pytest.skip("training.enable_cpu_offload is refused on the CPU: there is nothing to offload")
    extra = ["--training.enable_cpu_offload"] if offload else []
    result = train([*JOB, *DETERMINISTIC, *dtype_args("bfloat16"), "--training.steps", "3", "--metrics.fingerprints",
                    *extra, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    prints = [json.loads(line) for line in (tmp_path / "fingerprints.jsonl").open()]
    steps = step_records(tmp_path)
    assert [p["step"] for p in prints] == [1, 2, 3]
    for p in prints:
        for quantity in ("grad_norm", "update_norm", "param_norm", "output_rms", "grad_rms", "attention_rms", "ffn_rms"):
            assert all(v is not None and math.isfinite(v) and v > 0 for v in p[quantity].values()), quantity
        total = math.sqrt(sum(v * v for v in p["grad_norm"].values()))
        assert total == pytest.approx(steps[p["step"]]["grad_norm"], rel=1e-9)
    figure(f"fingerprints bfloat16{', cpu offload' if offload else ''}, 3 steps: block output RMS {prints[0]['output_rms']['0']:.4f} (block 0, step 1), "
           f"gradient norms add up to the logged norm {steps[1]['grad_norm']:.6f}")
