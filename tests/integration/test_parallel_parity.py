"""The parity matrix: every parallel layout trains like the 1D FSDP control.

All runs start from one seed checkpoint and train the tiny Llama (4 layers) for 20 steps in fp32
with deterministic algorithms, at data-parallel degree 2 and local batch 4 (global batch 8). The
HSDP set is compared with FSDP over 4 ranks at local batch 2 (the same global batch).
Targets (ARCHITECTURE.md): step-1 |loss diff| <= 1e-5, max |loss diff| over the 20 steps
<= 1e-4, step-1 grad-norm relative diff <= 1e-5. Every run records per-module fingerprints
(metrics.fingerprints, steps 1-4): each parameter's gradient, update and value norm and each
block's output, gradient, attention-branch and FFN-branch RMS must agree with the control's to 1e-4
relative (the worst measured is about 1e-5, an update norm of a norm weight), and the gradient
norms must add up to the logged global norm.

The layouts of the convergence protocol's cpu_smoke plan (FSDP+TP+PP, FSDP+TP+CP+PP, FSDP+CP, full
AC; 8, 16, 4 and 2 processes) are checked against the same targets over the same 20 steps by
tests/protocol/test_end_to_end.py, so the suite runs each layout once; the others are here.
torch.compile is checked against eager in every layout by tests/integration/test_compile_parity.py.

The runs of each process count share one process group (tests/workers/run_many.py, the trainer's
own `Trainer` run by run): the 2-process layouts one, the 4-process layouts and the 3-step runs of
the other pipeline schedules another, so the matrix starts torch in 6 processes rather than 46.
Each run's rank-0 log is checked as the launcher shows it; the launch path itself (launcher,
preflight, one process group per run) is what the cpu_smoke plan's layouts take
(tests/protocol/test_end_to_end.py), as every other launching test does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import describe, launch, run_many

# Its fixtures run the layouts of 2 to 8 ranks: they keep both cores busy (tests/machine_share.py).
pytestmark = pytest.mark.cores(2)

STEPS = 20
JOB = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", str(STEPS),
    "--training.local_batch_size", "4", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard",
    "--debug.deterministic", "--metrics.fingerprints",
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@dataclass(frozen=True)
class Layout:
    nproc: int
    overrides: tuple[str, ...]
    control: str = "FSDP dp2"
    expect_log: str = ""  # a line the run must log: proof the layout was really applied
    expect_runtime: str = ""  # part of a `runtime:` line: how its blocks compute (the model's runtime)


LAYOUTS = {
    "FSDP dp2": Layout(2, ()),
    "FSDP dp4": Layout(4, ("--training.local_batch_size", "2")),
    "DDP dp2": Layout(2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                          "1"), expect_log="DDP 2 replicas x 1 shards"),
    "HSDP 2x2": Layout(4, ("--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"),
                       control="FSDP dp4", expect_log="HSDP 2 replicas x 2 shards"),
    "FSDP+TP2": Layout(4, (*TP2,), expect_log="TP 2 with sequence parallelism and loss parallelism",
                       expect_runtime="runtime: blocks 0-3: attention causal SDPA over whole sequences, documents by "
                                      "mask; norm weights: TP gradient sum in float32"),
    "FSDP+PP2 1F1B": Layout(4, (*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
                            expect_log="PP 2 (1F1B, 2 stages)"),
    "FSDP+PP2 Interleaved1F1B": Layout(4, (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
                                       expect_log="PP 2 (Interleaved1F1B, 4 stages)"),
    "FSDP+AC selective op": Layout(2, ("--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op"),
                                   expect_log="activation checkpointing selective (op)",
                                   expect_runtime="runtime: blocks 0-3: attention causal SDPA over whole sequences, "
                                                  "documents by mask; recompute cheap ops"),
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
    fingerprints: list[dict]


# The other pipeline schedules: 3 steps each (see test_other_pipeline_schedules_match_the_control).
SCHEDULES = [("GPipe", 2), ("LoopedBFS", 4), ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4), ("DualPipeV", 4)]
# A split of one's own (parallelism.module_fqns_per_model_part), 3 steps as the schedules: not the
# default split (embedding and blocks 0-1, blocks 2-3 and output).
OWN_SPLIT = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]


@pytest.fixture(scope="module")
def runs(seed, tmp_path_factory):
    """name -> Run: every layout and schedule run, the first time one is needed, in one process
    group per process count; each checked as a launched run would be."""
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if not done:
            load = ["--checkpoint.initial_load_path", str(seed), "--checkpoint.load_only"]
            groups = {nproc: {n: [*layout.overrides, *load] for n, layout in LAYOUTS.items() if layout.nproc == nproc}
                      for nproc in sorted({layout.nproc for layout in LAYOUTS.values()})}
            expect_log = {name: layout.expect_log for name, layout in LAYOUTS.items()}
            for schedule, stages in SCHEDULES:
                groups[4][f"schedule {schedule}"] = ["--training.steps", "3", *PP2,
                                                     "--parallelism.pipeline_parallel_schedule", schedule, *load]
                expect_log[f"schedule {schedule}"] = f"PP 2 ({schedule}, {stages} stages)"
            groups[4]["own split"] = ["--training.steps", "3", *PP2, "--parallelism.pipeline_parallel_schedule", "1F1B",
                                      "--parallelism.module_fqns_per_model_part", json.dumps(OWN_SPLIT), *load]
            expect_log["own split"] = ("pipeline: stage 0 (pp rank 0): embedding, layer 0; stage 1 (pp rank 1): layer 1, "
                                       "layer 2, layer 3, output")
            for nproc, group in groups.items():
                found, output = run_many(nproc, JOB, group, tmp_path_factory.mktemp(f"parity-{nproc}"), timeout=1800)
                # The gradient norm is one float64 all-reduce over every rank, not one per mesh dimension.
                assert "sequential all_reduce" not in output.stdout + output.stderr
                for run, result in found.items():
                    log = result["log"]
                    assert f"loaded model from {seed}" in log, (run, log[-2000:])
                    assert expect_log[run] in log, (run, log[-2000:])  # the layout was really applied
                    if run in LAYOUTS:
                        assert LAYOUTS[run].expect_runtime in log, (run, log[-2000:])
                    steps = 3 if run.startswith("schedule ") or run == "own split" else STEPS
                    records = result["metrics"]
                    assert [r["step"] for r in records] == list(range(1, steps + 1)), run
                    # Rank 0 (the first pipeline stage under PP) logs the global loss.
                    assert f"step {steps}" in log and f"loss {records[-1]['loss']:.4f}" in log, (run, log[-2000:])
                    prints = [json.loads(line) for line in (Path(result["dump"]) / "fingerprints.jsonl").open()]
                    done[run] = Run(records, result["seconds"], prints)
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


@pytest.mark.parametrize("schedule, stages", SCHEDULES)
def test_other_pipeline_schedules_match_the_control(schedule, stages, runs, measured):
    """3 steps: with 2 warmup steps, the losses of steps 1-3 do not depend on the total step count,
    so they must equal the first 3 of the 20-step control."""
    matches_the_first_3_steps(f"schedule {schedule}", runs, measured)


def test_a_pipeline_split_of_ones_own_matches_the_control(runs, measured):
    matches_the_first_3_steps("own split", runs, measured)


def matches_the_first_3_steps(name: str, runs, measured) -> None:
    control, test = runs("FSDP dp2").records[:3], runs(name).records
    diffs = [abs(c["loss"] - t["loss"]) for c, t in zip(control, test)]
    norm_diff = abs(control[0]["grad_norm"] - test[0]["grad_norm"]) / control[0]["grad_norm"]
    measured(f"parity FSDP+PP2 {name.removeprefix('schedule '):22s} 4 procs: max |dloss| over 3 steps {max(diffs):.1e}, "
             f"step-1 grad-norm rel diff {norm_diff:.1e}")
    assert len(test) == 3 and max(diffs) <= 1e-5 and norm_diff <= 1e-5


FINGERPRINT_TOLERANCE = 1e-4  # relative; correct layouts measure about 1e-5 at worst


def worst_fingerprint_difference(control: list[dict], test: list[dict]) -> tuple[float, str]:
    """The largest relative difference between two runs' fingerprints, and where it is."""
    worst, where = 0.0, ""
    for a, b in zip(control, test):
        for quantity in ("grad_norm", "update_norm", "param_norm", "output_rms", "grad_rms", "attention_rms", "ffn_rms"):
            assert a[quantity].keys() == b[quantity].keys(), quantity
            for entry, x in a[quantity].items():
                difference = abs(b[quantity][entry] - x) / abs(x)
                if difference > worst:
                    worst, where = difference, f"step {a['step']} {quantity} {entry}"
    return worst, where


@pytest.mark.parametrize("name", [*TEST_SETS, *(f"schedule {schedule}" for schedule, _ in SCHEDULES)])
def test_fingerprints_agree_with_the_control(name, runs, measured):
    test = runs(name)
    control = runs(LAYOUTS[name].control if name in LAYOUTS else "FSDP dp2")
    steps = [p["step"] for p in test.fingerprints]
    assert steps == ([1, 2, 3] if name.startswith("schedule ") else [1, 2, 3, 4])  # fingerprint_first = 4
    # A 3-step schedule run decays its learning rate from step 3 on: its updates from then on differ.
    compared = 2 if name.startswith("schedule ") else 4
    worst, where = worst_fingerprint_difference(control.fingerprints[:compared], test.fingerprints[:compared])
    measured(f"fingerprints {name:26s}: worst relative difference {worst:.1e} ({where})")
    assert worst <= FINGERPRINT_TOLERANCE, where
    for prints, records in ((test.fingerprints, test.records), (control.fingerprints, control.records)):
        for p in prints:  # each parameter once, every shard counted: they add up to the global norm
            total = math.sqrt(sum(norm ** 2 for norm in p["grad_norm"].values()))
            assert total == pytest.approx(records[p["step"] - 1]["grad_norm"], rel=1e-9)
