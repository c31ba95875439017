"""Tensor parallelism with reduced synchronization (parallelism.tensor_parallel_sync): the model it
defines, the collectives it issues, and its composition with FSDP, PP, AC and checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, TINY_JOB, describe, launch, read_metrics, run_many

# Runs of 2 and 4 ranks that keep both cores busy (tests/machine_share.py).
pytestmark = pytest.mark.cores(2)

BLOCKS = 4  # the tiny flavor's
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PER_BLOCK = ["--parallelism.tensor_parallel_sync", "per_block"]
GROUPED_2 = ["--parallelism.tensor_parallel_sync", "grouped", "--parallelism.tensor_parallel_sync_group", "2"]


def losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump) if "kind" not in r}


@pytest.mark.smoke
def test_each_variant_computes_its_definition(tmp_path):
    """Two TP ranks against a one-process computation of each rank's partial sums from slices of
    the whole weights (tests/workers/reduced_sync_math.py), with the output projections scaled up
    so that the variants differ from exact TP by far more than rounding."""
    out = tmp_path / "math.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "-m", "tests.workers.reduced_sync_math", str(out)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert result.returncode == 0, describe(result)
    found = json.loads(out.read_text())
    for variant, diffs in found.items():
        assert diffs["logits"] <= 1e-5 and diffs["gradients"] <= 1e-5, (variant, diffs)
    assert found["full"]["from_exact_tp"] == 0.0
    distances = [found[v]["from_exact_tp"] for v in ("per_block", "grouped 2", "grouped 4")]
    assert distances[0] > 1e-2 and distances == sorted(distances), distances  # fewer syncs, further away


GROUPED_3 = ["--parallelism.tensor_parallel_sync", "grouped", "--parallelism.tensor_parallel_sync_group", "3"]
VARIANTS = {"per_block": PER_BLOCK, "grouped 2": GROUPED_2, "grouped 3": GROUPED_3}


@pytest.fixture(scope="module")
def counted_variants(tmp_path_factory) -> dict[str, dict]:
    """variant -> its run's results: the three runs one after the other in one 2-process group
    (tests/workers/run_many.py)."""
    found, _ = run_many(2, [*TINY_JOB, "--training.steps", "2", "--metrics.count_collectives", *TP2], VARIANTS,
                        tmp_path_factory.mktemp("sync-variants"))
    return found


@pytest.mark.parametrize("variant, syncs", [("per_block", BLOCKS), ("grouped 2", BLOCKS // 2), ("grouped 3", 2)])
def test_syncs_are_counted_per_variant(counted_variants, variant, syncs):
    """Per group: one all-gather and one reduce-scatter forward, their mirror images backward, plus
    the embedding's reduce-scatter and the final norm's all-gather; every norm weight's gradient is
    still all-reduced (2 per block and the final norm)."""
    result = counted_variants[variant]
    summary = json.loads((Path(result["dump"]) / "run_meta.json").read_text())["collectives"]
    tp = summary["by_dimension"]["tp"]
    per_forward = syncs + 1
    assert tp["forward"] == {"all_gather_into_tensor": per_forward, "reduce_scatter_tensor": per_forward}
    assert tp["backward"] == {"all_gather_into_tensor": per_forward, "reduce_scatter_tensor": per_forward,
                              "all_reduce": 2 * BLOCKS + 1}
    assert summary["tp_syncs_per_forward"] == per_forward
    label = "once per block" if variant == "per_block" else f"once per {variant.split()[1]} blocks"
    assert f"TP 2 with sequence parallelism and loss parallelism, synchronized {label}" in result["log"]


def test_fsdp_tp_with_checkpointed_activations_resumes_exactly(tmp_path):
    """FSDP 2 x TP 2, grouped by 2, selective AC keeping the collectives: a run resumed from its
    step-4 checkpoint repeats the uninterrupted run's losses bitwise."""
    job = [*TINY_JOB, "--training.steps", "8", "--training.local_batch_size", "4", *TP2, *GROUPED_2,
           "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
           "--checkpoint.enable", "--checkpoint.interval", "4"]
    result = launch(4, [*job, "--job.dump_folder", str(tmp_path / "full")])
    assert result.returncode == 0, describe(result)
    assert "FSDP over 2 ranks" in result.stdout and "Warning" not in result.stderr
    # The model's runtime, as the log prints it: groups of 2 blocks, the first gathers, the last scatters.
    block = ("attention causal SDPA over whole sequences, documents by mask; recompute cheap ops; sync reduced over TP 2: "
             "{}; linear layers on their local shard; norm weights: partial sums, TP gradient sum in float32")
    assert f"runtime: block 0: {block.format('all-gathers its input')}\n" in result.stdout
    assert f"runtime: block 1: {block.format('reduce-scatters its output')}\n" in result.stdout
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-4", tmp_path / "resumed" / "checkpoint" / "step-4")
    result = launch(4, [*job, "--job.dump_folder", str(tmp_path / "resumed")])
    assert result.returncode == 0, describe(result)
    uninterrupted, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert min(resumed) == 5 and [resumed[s] for s in range(5, 9)] == [uninterrupted[s] for s in range(5, 9)]


def test_pipeline_stages_train_the_same_model(tmp_path):
    """TP 2 grouped by 2 with and without PP 2 (the stages end where the groups end), with full
    AC under PP: the same model, so the losses agree as layouts do (1e-6 in fp32), while exact
    TP trains a different model, many times further away."""
    job = [*TINY_JOB, "--training.steps", "6", "--training.local_batch_size", "4", *TP2]
    found, _ = run_many(2, job, {"exact": [], "grouped": GROUPED_2}, tmp_path)  # in one 2-process group
    result = launch(4, [*job, *GROUPED_2, "--parallelism.pipeline_parallel_degree", "2", "--activation_checkpoint.mode",
                        "full", "--job.dump_folder", str(tmp_path / "grouped_pp")])
    assert result.returncode == 0, describe(result)
    assert "PP 2 (1F1B, 2 stages)" in result.stdout
    exact, grouped = (losses(Path(found[name]["dump"])) for name in ("exact", "grouped"))
    grouped_pp = losses(tmp_path / "grouped_pp")
    pipeline_diff = max(abs(grouped[s] - grouped_pp[s]) for s in range(1, 7))
    model_diff = max(abs(grouped[s] - exact[s]) for s in range(1, 7))
    assert pipeline_diff <= 1e-6 and model_diff > 10 * max(pipeline_diff, 1e-6), (pipeline_diff, model_diff)


def test_fingerprints_leave_out_the_partial_streams_inside_a_group(tmp_path):
    """metrics.fingerprints under grouped syncs: a block inside a group hands on a partial stream,
    so it has no output or gradient figures (null); the blocks that end a group have them. No block
    has branch figures (each rank's attention and FFN outputs are partial sums). Every parameter's
    gradient norm is recorded and adds up to the logged global norm."""
    result = launch(2, [*TINY_JOB, "--training.steps", "2", *TP2, *GROUPED_2, "--metrics.fingerprints",
                        "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    norms = {r["step"]: r["grad_norm"] for r in read_metrics(tmp_path) if "kind" not in r}
    for line in map(json.loads, (tmp_path / "fingerprints.jsonl").open()):
        for quantity in ("output_rms", "grad_rms"):
            assert [name for name, value in line[quantity].items() if value is None] == ["0", "2"], line[quantity]
        for quantity in ("attention_rms", "ffn_rms"):
            assert line[quantity] == {"0": None, "1": None, "2": None, "3": None}, line[quantity]
        total = sum(value ** 2 for value in line["grad_norm"].values()) ** 0.5
        assert total == pytest.approx(norms[line["step"]], rel=1e-9)
