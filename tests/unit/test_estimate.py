"""trainer.estimate at a fake world size of 64, in seconds: exact state bytes from the FSDP
sharding rule, the pipeline's rank kinds, and the command line (fit check, --strict, errors)."""

from __future__ import annotations

import json
import math
import time

import torch

import pytest

from trainer.estimate.__main__ import main
from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.estimate.rank import rank_kinds
from trainer.models.llama3 import Transformer
from trainer.models.llama3.hf_config import configured_model_args
from trainer.parallel.dims import stage_plan
from trainer.preflight.checks import plan_layout

DEBUG = ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.local_batch_size", "2",
         "--training.mixed_precision_param", "float32"]


def first_shard_bytes(shape: torch.Size, world: int, element_size: int = 4) -> int:
    """FSDP2 cuts dim 0 into `world` chunks of ceil(rows / world); rank 0 holds the first."""
    rows = min(math.ceil(shape[0] / world), shape[0])
    return rows * math.prod(shape[1:]) * element_size


def test_fsdp_over_64_fake_ranks_holds_the_first_shard_of_every_parameter():
    config, _ = estimated_config(DEBUG)
    plan = plan_layout(config, 64)
    started = time.perf_counter()
    [estimate] = estimate_kinds(DEBUG, 64, rank_kinds(plan.dims, None), steps=1)
    assert time.perf_counter() - started < 60
    with torch.device("meta"):
        params = list(Transformer(configured_model_args(config.model)).parameters())
    expected = sum(first_shard_bytes(p.shape, 64) for p in params)
    assert estimate.kind.ranks == "0-63"
    assert estimate.state.parameters == expected
    assert estimate.state.gradients == expected
    # AdamW: two moments of the parameter's shape and a float32 step count per parameter
    assert estimate.state.optimizer == 2 * expected + 4 * len(params)
    assert estimate.step_peak.total > estimate.state.parameters + estimate.state.optimizer
    fsdp = estimate.collectives["dp_shard"]  # the FSDP group (every rank: its first mesh name)
    # one all-gather per FSDP unit (each block, the root) in forward, again in backward for all but
    # the last block (kept unsharded after forward), and one reduce-scatter per unit
    units = configured_model_args(config.model).n_layers + 1
    assert fsdp["_reduce_scatter_base_"]["calls"] == units
    assert fsdp["_allgather_base_"]["calls"] == 2 * units - 1


@pytest.mark.cores(2)
def test_pipeline_rank_kinds_hold_the_first_shards_of_their_stages():
    args = [*DEBUG, "--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", "4"]
    config, _ = estimated_config(args)
    plan = plan_layout(config, 64)
    stages = stage_plan(config, plan.dims)
    kinds = rank_kinds(plan.dims, stages)
    assert [(k.rank, k.ranks, k.stages) for k in kinds] == [(0, "0-15", (0,)), (32, "32-47", (2,)), (48, "48-63", (3,))]
    with torch.device("meta"):
        model = Transformer(configured_model_args(config.model))
    for estimate in estimate_kinds(args, 64, kinds, steps=1):
        [stage] = estimate.kind.stages
        owned = [f"layers.{b}." for b in stages.blocks[stage]]
        owned += ["tok_embeddings."] if stage == 0 else []
        owned += ["norm.", "output."] if stage == stages.num_stages - 1 else []
        expected = sum(first_shard_bytes(p.shape, 16) for name, p in model.named_parameters()
                       if name.startswith(tuple(owned)))
        assert estimate.state.parameters == expected, estimate.kind
        # 4 microbatches: activations sent forward, their gradients received back, per neighbour
        neighbours = 1 if stage in (0, stages.num_stages - 1) else 2
        assert estimate.collectives["pp"]["send"]["calls"] == estimate.collectives["pp"]["recv_"]["calls"] == \
            4 * neighbours


def test_a_rank_that_does_not_fit_is_a_warning_with_the_remedies_estimated_and_strict_exits_2(capsys, tmp_path):
    # The debug model with a long sequence: activations dominate, so full recomputation fits
    # in 200 MiB and the other remedies do not (one local batch per rank already).
    job = [*DEBUG, "--training.seq_len", "2048", "--training.local_batch_size", "1"]
    args = ["--nproc", "2", "--device-memory", "200MiB", "--json", str(tmp_path / "e.json"), *job]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NO (" in out and "warning: every rank (ranks 0-1) needs" in out and "largest at the step peak: activ" in out
    figures = json.loads((tmp_path / "e.json").read_text())
    assert figures["nproc"] == 2 and figures["ranks"][0]["fits"] is False
    changes = {c["change"]: c for c in figures["changes"]}
    assert changes['activation_checkpoint.mode = "full"']["fits"] is True
    assert [c["fits"] for c in figures["changes"]] == [True, False]  # AC full; twice the ranks: not enough
    assert figures["changes"][1]["nproc"] == 4
    assert main(["--strict", "--no-changes", *args]) == 2
    assert "changes, each estimated" not in capsys.readouterr().out
    assert main(["--nproc", "2", "--device-memory", "80GiB", "--strict", *DEBUG]) == 0


def test_user_mistakes_get_one_clear_error(capsys):
    assert main(["--nproc", "3", "--parallelism.tensor_parallel_degree", "2", *DEBUG]) == 2
    assert "world size 3" in capsys.readouterr().err
    assert main(["--nproc", "2", "--rank", "5", *DEBUG]) == 2
    assert "--rank 5: the world has ranks 0-1" in capsys.readouterr().err
    assert main(["--nproc", "2", "--device-memmory", "40GiB", *DEBUG]) == 2
    err = capsys.readouterr().err
    assert "--device-memmory: not an option of python -m trainer.estimate" in err
    assert err.rstrip().endswith("did you mean --device-memory?") and err.count("\n") == 1


def test_context_parallel_estimates_with_the_ring_counted_as_cp_traffic():
    # The ring attention runs as custom ops: the memory tracker runs their bodies on fake tensors
    # (their hops send nothing), and each call counts the bytes its hops would send.
    args = [*DEBUG, "--parallelism.context_parallel_degree", "2"]
    config, _ = estimated_config(args)
    [estimate] = estimate_kinds(args, 8, rank_kinds(plan_layout(config, 8).dims, None), steps=1)
    model_args = configured_model_args(config.model)
    cp = estimate.collectives["cp"]
    assert cp["ring_attention"]["calls"] == cp["ring_attention_backward"]["calls"] == model_args.n_layers
    # Per layer, forward: the stacked local K and V (2 x B x T/2 x H_kv x D float32) on 1 hop;
    # backward: the same again, and their gradient sums on 2 hops.
    kv = 2 * 2 * 64 * model_args.kv_heads * model_args.head_dim * 4
    assert cp["ring_attention"]["bytes"] == model_args.n_layers * kv
    assert cp["ring_attention_backward"]["bytes"] == model_args.n_layers * 3 * kv
    assert estimate.step_peak.activations > 0


def test_what_the_estimate_leaves_out_on_cuda_is_said_on_its_first_line():
    documents = [*DEBUG, "--training.dataset", "files", "--training.document_masking"]
    _, notes = estimated_config(documents)  # 16 heads over 4 K/V heads
    assert any("masked grouped-query attention repeats the K/V heads 4x" in note for note in notes)
    _, notes = estimated_config([*documents, "--parallelism.context_parallel_degree", "2"])
    assert any("ring attention's masked chunk pairs run a float32 math kernel" in note for note in notes)
    _, notes = estimated_config(DEBUG)
    assert not any("not counted" in note for note in notes)


def test_an_older_torch_is_named_for_its_optimizer_temporaries(monkeypatch):
    from trainer.estimate import job

    monkeypatch.setattr(job, "torch_version", lambda: "2.11.0")
    assert any("torch 2.11.0: the optimizer step's temporaries" in note for note in estimated_config(DEBUG)[1])
    monkeypatch.setattr(job, "torch_version", lambda: "2.13.0")
    assert not any("temporaries" in note for note in estimated_config(DEBUG)[1])
