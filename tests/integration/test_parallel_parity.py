"""The parity matrix: every parallel layout trains like the 1D FSDP control.

All runs start from one seed checkpoint and train the tiny Llama (4 layers) for 20 steps in fp32
with deterministic algorithms, at data-parallel degree 2 and local batch 4 (global batch 8). The
HSDP set is compared with FSDP over 4 ranks at local batch 2 (the same global batch).
Targets (ARCHITECTURE.md): step-1 |loss diff| <= 1e-5, max |loss diff| over the 20 steps
<= 1e-4, step-1 grad-norm relative diff <= 1e-5.

The layouts of the convergence protocol's cpu_smoke plan (FSDP+TP+PP, FSDP+TP+CP+PP, FSDP+CP, full
AC; 8, 16, 4 and 2 processes) are checked against the same targets over the same 20 steps by
tests/protocol/test_end_to_end.py, so the suite runs each layout once; the others are here.
torch.compile is checked against eager in every layout by tests/integration/test_compile_parity.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from tests.launch import describe, launch, read_metrics

STEPS = 20
JOB = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", str(STEPS),
    "--training.local_batch_size", "4", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard",
    "--debug.deterministic",
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@dataclass(frozen=True)
class Layout:
    nproc: int
    overrides: tuple[str, ...]
    control: str = "FSDP dp2"
    expect_log: str = ""  # a line the run must log: proof the layout was really applied


LAYOUTS = {
    "FSDP dp2": Layout(2, ()),
    "FSDP dp4": Layout(4, ("--training.local_batch_size", "2")),
    "DDP dp2": Layout(2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                          "1"), expect_log="DDP 2 replicas x 1 shards"),
    "HSDP 2x2": Layout(4, ("--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"),
                       control="FSDP dp4", expect_log="HSDP 2 replicas x 2 shards"),
    "FSDP+TP2": Layout(4, (*TP2,), expect_log="TP 2 with sequence parallelism and loss parallelism"),
    "FSDP+PP2 1F1B": Layout(4, (*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
                            expect_log="PP 2 (1F1B, 2 stages)"),
    "FSDP+PP2 Interleaved1F1B": Layout(4, (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
                                       expect_log="PP 2 (Interleaved1F1B, 4 stages)"),
    "FSDP+AC selective op": Layout(2, ("--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op"),
                                   expect_log="activation checkpointing selective (op)"),
}
TEST_SETS = [name for name in LAYOUTS if name not in ("FSDP dp2", "FSDP dp4")]


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    dump = tmp_path_factory.mktemp("parity-seed")
    result = launch(1, [*JOB, "--debug.seed", "5", "--job.dump_folder", str(dump), "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 0, describe(result)
    return dump / "checkpoint" / "step-0"


@dataclass
class Run:
    records: list[dict]
    wall_s: float


@pytest.fixture(scope="module")
def runs(seed, tmp_path_factory):
    """name -> Run, each layout launched once, when first needed."""
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in done:
            layout = LAYOUTS[name]
            dump = tmp_path_factory.mktemp(name.replace(" ", "_").replace("+", "_"))
            start = time.perf_counter()
            result = launch(layout.nproc, [*JOB, *layout.overrides, "--checkpoint.initial_load_path", str(seed),
                                           "--checkpoint.load_only", "--job.dump_folder", str(dump)], timeout=600)
            assert result.returncode == 0, describe(result)
            assert f"loaded model from {seed}" in result.stdout
            assert layout.expect_log in result.stdout, describe(result)
            # The gradient norm is one float64 all-reduce over every rank, not one per mesh dimension.
            assert "sequential all_reduce" not in result.stdout + result.stderr
            records = read_metrics(dump)
            assert [r["step"] for r in records] == list(range(1, STEPS + 1))
            # The launcher shows rank 0 (the first pipeline stage under PP): it logs the global loss.
            assert f"step {STEPS}" in result.stdout and f"loss {records[-1]['loss']:.4f}" in result.stdout
            done[name] = Run(records, time.perf_counter() - start)
        return done[name]

    return get


@pytest.mark.parametrize("name", TEST_SETS)
def test_layout_trains_like_the_fsdp_control(name, runs, measured):
    layout = LAYOUTS[name]
    control, test = runs(layout.control).records, runs(name).records
    diffs = [abs(c["loss"] - t["loss"]) for c, t in zip(control, test)]
    norm_diff = abs(control[0]["grad_norm"] - test[0]["grad_norm"]) / control[0]["grad_norm"]
    measured(f"parity {name:26s} vs {layout.control:9s} {layout.nproc:2d} procs: step-1 |dloss| {diffs[0]:.1e}, "
             f"max |dloss| over {STEPS} steps {max(diffs):.1e}, step-1 grad-norm rel diff {norm_diff:.1e}, "
             f"final loss {test[-1]['loss']:.5f} (from {test[0]['loss']:.5f}), {runs(name).wall_s:.0f} s")
    assert test[-1]["loss"] < test[0]["loss"] - 0.2  # it trains
    assert diffs[0] <= 1e-5
    assert max(diffs) <= 1e-4
    assert norm_diff <= 1e-5


def test_fsdp_controls_of_both_dp_degrees_agree(runs, measured):
    """Invariant 1 on its own: FSDP dp2 x batch 4 and FSDP dp4 x batch 2 see the same global batches."""
    a, b = runs("FSDP dp2").records, runs("FSDP dp4").records
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    measured(f"parity FSDP dp4 x 2 vs FSDP dp2 x 4: max |dloss| over {STEPS} steps {max(diffs):.1e}")
    assert max(diffs) <= 1e-4


@pytest.mark.parametrize("schedule, stages", [
    ("GPipe", 2), ("LoopedBFS", 4), ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4), ("DualPipeV", 4)])
def test_other_pipeline_schedules_match_the_control(schedule, stages, seed, runs, tmp_path, measured):
    """3 steps: with 2 warmup steps, the losses of steps 1-3 do not depend on the total step count,
    so they must equal the first 3 of the 20-step control."""
    result = launch(4, [*JOB, "--training.steps", "3", *PP2, "--parallelism.pipeline_parallel_schedule", schedule,
                        "--checkpoint.initial_load_path", str(seed), "--checkpoint.load_only",
                        "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert f"PP 2 ({schedule}, {stages} stages)" in result.stdout
    control, test = runs("FSDP dp2").records[:3], read_metrics(tmp_path)
    diffs = [abs(c["loss"] - t["loss"]) for c, t in zip(control, test)]
    norm_diff = abs(control[0]["grad_norm"] - test[0]["grad_norm"]) / control[0]["grad_norm"]
    measured(f"parity FSDP+PP2 {schedule:22s} 4 procs: max |dloss| over 3 steps {max(diffs):.1e}, "
             f"step-1 grad-norm rel diff {norm_diff:.1e}")
    assert len(test) == 3 and max(diffs) <= 1e-5 and norm_diff <= 1e-5
