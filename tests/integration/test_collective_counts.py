"""metrics.count_collectives: the collectives of a training step, counted by mesh dimension,
part of the step and operation, as they are issued."""

from __future__ import annotations

import json

import pytest

from tests.launch import TINY_JOB, describe, launch, read_metrics
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError
from trainer.preflight.checks import plan_run

# Runs of 2 to 4 ranks that keep both cores busy (tests/machine_share.py).
pytestmark = pytest.mark.cores(2)

BLOCKS = 4  # the tiny flavor's
JOB = [*TINY_JOB, "--training.steps", "2", "--metrics.count_collectives", "--metrics.log_freq", "1"]


def counted(tmp_path, nproc: int, *args: str) -> tuple[dict, str]:
    result = launch(nproc, [*JOB, *args, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    return json.loads((tmp_path / "run_meta.json").read_text())["collectives"], result.stdout


def test_tensor_parallel_step_issues_two_syncs_per_block(tmp_path):
    """TP 2 with sequence parallelism: entering attention and the FFN all-gathers the sequence,
    leaving them reduce-scatters it (2 per block), plus the embedding's output (1) and the final
    norm's input (1); the backward pass mirrors them and all-reduces each norm's weight gradient."""
    summary, stdout = counted(tmp_path, 2, "--parallelism.tensor_parallel_degree", "2")
    per_forward = 2 * BLOCKS + 1
    tp = summary["by_dimension"]["tp"]
    assert tp["forward"] == {"all_gather_into_tensor": per_forward, "reduce_scatter_tensor": per_forward}
    assert tp["backward"] == {"all_gather_into_tensor": per_forward, "reduce_scatter_tensor": per_forward,
                              "all_reduce": 2 * BLOCKS + 1}
    assert summary["tp_syncs_per_forward"] == per_forward and summary["forward_passes"] == 1
    assert summary["step"] == 1 and "collectives of step 1 on this rank: " in stdout
    [record] = [r for r in read_metrics(tmp_path) if r.get("kind") == "collectives"]
    assert record["collectives/tp_forward"] == 2 * per_forward and record["collectives/tp_syncs_per_forward"] == 9


def test_fsdp_with_accumulation_counts_every_microbatch(tmp_path):
    """FSDP 2 x TP 2, two microbatches: per microbatch FSDP all-gathers each block and the root in
    the forward pass, the blocks again in the backward pass, and reduce-scatters every gradient."""
    summary, _ = counted(tmp_path, 4, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size",
                         "2", "--training.global_batch_size", "8")
    units = BLOCKS + 1  # FSDP units: the blocks and the root
    fsdp = summary["by_dimension"]["dp_shard_cp"]
    assert summary["forward_passes"] == 2
    assert fsdp["forward"] == {"_allgather_base_": 2 * units}
    assert fsdp["backward"] == {"_allgather_base_": 2 * BLOCKS, "_reduce_scatter_base_": 2 * units}
    assert summary["tp_syncs_per_forward"] == 2 * BLOCKS + 1  # per microbatch, as with one


def test_fingerprints_add_no_collective_to_the_counted_step(tmp_path):
    """metrics.fingerprints at the counted step: its one all-reduce comes after the count, so
    the counts are those of a run without fingerprints."""
    tp = ("--parallelism.tensor_parallel_degree", "2")
    plain, _ = counted(tmp_path / "plain", 2, *tp)
    with_prints, _ = counted(tmp_path / "prints", 2, *tp, "--metrics.fingerprints")
    assert with_prints == plain
    assert (tmp_path / "prints" / "fingerprints.jsonl").is_file()


def test_counting_is_refused_with_compile():
    config = JobConfig()
    config.metrics.count_collectives, config.compile.enable = True, True
    with pytest.raises(ConfigError, match="metrics.count_collectives: counts in eager mode"):
        plan_run(config, 1)
