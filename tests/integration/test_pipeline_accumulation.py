"""Gradient accumulation under pipeline parallelism: the local batches of all accumulation steps
of an optimizer step go through ONE schedule step (trainer/step.py), so FSDP's gradient reduction,
the all-reduce across replicas (DDP, HSDP) included, runs once per step, and every pipeline
microbatch, with its loss (cross-entropy sum / global target tokens), is the one it would be
without accumulation.

Each run trains the tiny Llama for 3 steps on global batches of 16 sequences in fp32 and counts
the collectives of step 1 on rank 0 (metrics.count_collectives). The reference is the same
pipeline without accumulation (local batch 8 = the whole of each DP rank's rows). Initialization
keeps each rank's shard as a slice of the full tensor (tests/unit/test_init_slices.py), so the
layouts start from the same weights without a seed checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import TINY_JOB, describe, launch, read_metrics, run_many

STEPS = 3
JOB = [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "16", "--metrics.count_collectives",
       # Validation after step 2 (step 3 trains after it) and at the end, one local batch per schedule step.
       "--validation.enable", "--validation.freq", "2", "--validation.steps", "1", "--validation.global_batch_size", "16"]
PP_DDP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
          "--parallelism.data_parallel_shard_degree", "1"]
PP_HSDP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
           "--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_schedule",
           "Interleaved1F1B"]
# FSDP units holding parameters on PP rank 0: under 1F1B its stage has the embedding (the stage's
# root) and blocks 0 and 1; under Interleaved1F1B its stages are 0 (embedding, block 0) and 2
# (block 3; that stage's root owns no parameter). One all-reduce across replicas each, per step.
RANK0_UNITS = 3


def batch(local: int) -> list[str]:
    return ["--training.local_batch_size", str(local), "--validation.local_batch_size", str(local)]


def run(tmp_path, nproc: int, local: int, *args: str) -> tuple[list[float], dict[str, int]]:
    """The losses of the run (training steps, then the validation losses) and the calls of step 1
    on rank 0, by (mesh dimension, op)."""
    result = launch(nproc, [*JOB, *batch(local), *args, "--job.dump_folder", str(tmp_path)], timeout=400)
    assert result.returncode == 0, describe(result)
    return figures(tmp_path)


def figures(tmp_path) -> tuple[list[float], dict[str, int]]:
    """What `run` returns, from the run's dump folder."""
    records = read_metrics(tmp_path)
    losses = [r["loss"] for r in records if "kind" not in r]
    assert len(losses) == STEPS
    validation = [r["validation/loss"] for r in records if r.get("kind") == "validation"]
    assert [r["step"] for r in records if r.get("kind") == "validation"] == [2, 3]  # at freq 2 and at the end
    losses += validation
    summary = json.loads((tmp_path / "run_meta.json").read_text())["collectives"]
    calls: dict[str, int] = {}
    for dim, passes in summary["by_dimension"].items():
        for ops in passes.values():
            for op, n in ops.items():
                calls[f"{dim} {op}"] = calls.get(f"{dim} {op}", 0) + n
    return losses, calls


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> dict[str, tuple[list[float], dict[str, int]]]:
    """The 4-process runs, one after the other in one process group (tests/workers/run_many.py):
    PP 2 x DDP 2 (1F1B) without accumulation, local batch 8 (one local batch, 8 pipeline
    microbatches per step), and with it, local batch 4."""
    found, _ = run_many(4, JOB, {"without accumulation": [*batch(8), *PP_DDP], "PP2 x DDP2 1F1B": [*batch(4), *PP_DDP]},
                        tmp_path_factory.mktemp("pp-4-processes"))
    return {name: figures(Path(result["dump"])) for name, result in found.items()}


@pytest.fixture(scope="module")
def without_accumulation(four_processes):
    return four_processes["without accumulation"]


@pytest.mark.parametrize("nproc, layout, local, reduce_scatters", [
    (4, PP_DDP, 4, 0),  # 2 accumulation steps of 4 sequences (DP 2), a single-stage schedule
    (8, PP_HSDP, 2, RANK0_UNITS),  # 2 accumulation steps of 2 sequences (DP 4), two stages per rank
], ids=["PP2 x DDP2 1F1B", "PP2 x HSDP2x2 Interleaved1F1B"])
def test_accumulation_runs_one_schedule_step(nproc, layout, local, reduce_scatters, without_accumulation, tmp_path,
                                             measured, four_processes):
    reference, reference_calls = without_accumulation
    losses, calls = four_processes["PP2 x DDP2 1F1B"] if nproc == 4 else run(tmp_path, nproc, local, *layout)
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    all_reduces = calls["dp_replicate allreduce_"]
    measured(f"PP accumulation {nproc} procs: max |loss diff| vs no accumulation over {STEPS} steps and validation "
             f"{max(diffs):.1e}; replica all-reduces per step {all_reduces} (without accumulation "
             f"{reference_calls['dp_replicate allreduce_']})")
    assert max(diffs) <= 1e-6
    # Once per step and unit, as without accumulation; not once per accumulation step (2 x 3).
    assert reference_calls["dp_replicate allreduce_"] == RANK0_UNITS
    assert all_reduces == RANK0_UNITS
    # Under HSDP the reduce-scatter within a shard group runs once per step and unit too.
    assert calls.get("dp_shard_cp _reduce_scatter_base_", 0) == reduce_scatters
