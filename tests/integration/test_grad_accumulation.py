"""Gradient accumulation under DDP and HSDP all-reduces across replicas once per step.

The worker (tests/workers/accumulation_sync.py) runs one step of the trainer on 4 microbatches per
rank and counts the collectives, then runs the same batch with the all-reduce after every
microbatch. Both sum the same gradients, in a different order (float32 rounding only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO, TINY_JOB

# The tiny model is 5 FSDP units: 4 blocks and the root (embedding, final norm, output).
UNITS = 5


def run_worker(nproc: int, args: list[str], tmp_path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "tests.workers.accumulation_sync", *TINY_JOB, "--job.dump_folder", str(tmp_path), *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("nproc, layout", [
    (2, ["--parallelism.data_parallel_replicate_degree", "2"]),  # DDP 2 x 1
    (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),  # HSDP
], ids=["DDP2", "HSDP2x2"])
def test_one_all_reduce_per_step_under_accumulation(nproc, layout, tmp_path):
    local, accumulation = 2, 4
    replicas = 2
    shards = nproc // replicas
    run = run_worker(nproc, [*layout, "--training.local_batch_size", str(local), "--training.global_batch_size",
                             str(local * accumulation * replicas * shards)], tmp_path)
    print(run)
    assert run["microbatches"] == accumulation
    # One all-reduce of the step's target count, then one per FSDP unit: not one per unit and microbatch.
    assert run["once"].get("allreduce_") == 1 + UNITS
    assert run["every"].get("allreduce_") == 1 + UNITS * accumulation
    # Within a shard group the gradients are still reduce-scattered per microbatch (they stay sharded);
    # a shard group of one (DDP) has nothing to reduce-scatter.
    reduce_scatters = UNITS * accumulation if shards > 1 else 0
    assert run["once"].get("_reduce_scatter_base_", 0) == run["every"].get("_reduce_scatter_base_", 0) == reduce_scatters
    # The same sums in another order: float32 rounding of the largest gradient, no more.
    assert run["max_diff"] <= 1e-6 * run["max_grad"]
