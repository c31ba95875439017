"""Multi-process FSDP training on CPU with gloo, through the launcher."""

from __future__ import annotations

import math

import pytest

from tests.launch import TINY_JOB, describe, launch, read_metrics, run_many


def run_tiny(tmp_path, name, nproc, *extra):
    dump = tmp_path / name
    result = launch(nproc, [*TINY_JOB, "--job.dump_folder", str(dump), *extra])
    assert result.returncode == 0, describe(result)
    return result, read_metrics(dump)


@pytest.mark.smoke
def test_two_process_fsdp_loss_falls(tmp_path):
    result, records = run_tiny(tmp_path, "fsdp2", 2, "--training.local_batch_size", "4", "--training.steps", "30", "--optimizer.lr", "1e-2",
                               "--metrics.log_freq", "5")
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"2-process FSDP tiny model: loss {first:.4f} -> {last:.4f} in 30 steps")
    # At init the logits have variance ~1 (RMS-normalized hidden state, output std dim^-1/2), so the
    # expected cross-entropy is ~ ln(vocab) + 1/2.
    assert abs(first - (math.log(256) + 0.5)) < 0.2
    assert last < first - 1.0
    assert "outputs:" in result.stdout


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("parity"), "fsdp1", 1, "--training.local_batch_size", "8")[1]


SPLITS = {"2 ranks x batch 4": ["--training.local_batch_size", "4"],
          "2 ranks x batch 2 x 2 accumulation steps": ["--training.local_batch_size", "2",
                                                       "--training.global_batch_size", "8"]}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict[str, dict]:
    """The splits over 2 ranks, one after the other in one process group (tests/workers/run_many.py)."""
    found, _ = run_many(2, TINY_JOB, SPLITS, tmp_path_factory.mktemp("splits"))
    return found


@pytest.mark.parametrize("layout", list(SPLITS))
def test_same_global_batch_gives_same_losses(one_process_run, two_process_runs, layout):
    """1 process x batch 8 vs other splits of the same global batch, same seed-determined weights."""
    records = two_process_runs[layout]["metrics"]
    assert len(records) == len(one_process_run) == 10
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one_process_run, records)]
    norm_rel = abs(one_process_run[0]["grad_norm"] - records[0]["grad_norm"]) / one_process_run[0]["grad_norm"]
    print(f"{layout}: max |loss diff| over 10 steps {max(diffs):.2e}, step-1 grad norm rel diff {norm_rel:.2e}")
    assert all(r["tokens"] == 8 * 32 * r["step"] for r in records)
    assert max(diffs) <= 1e-5
    assert norm_rel <= 1e-5


@pytest.mark.parametrize("log_freq", [1, 5])
@pytest.mark.cores(2)
def test_non_finite_loss_stops_at_the_step_it_happened(tmp_path, log_freq):
    # An absurd learning rate without clipping turns the weights into inf/NaN after step 1.
    # Step 2 is a logging step with log_freq 1; with log_freq 5 it is read once step 3 is queued,
    # and step 3's checkpoint must not be written from the broken weights.
    result = launch(2, [*TINY_JOB, "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "2",
                        "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0",
                        "--metrics.log_freq", str(log_freq), "--checkpoint.enable", "--checkpoint.interval", "3"])
    assert result.returncode == 3, describe(result)  # diverged: not restarted
    assert "step 2: loss nan, gradient norm nan; stopping" in result.stderr, describe(result)  # the launcher's block
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert not list((tmp_path / "checkpoint").glob("step-*")), describe(result)
