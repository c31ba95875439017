"""The parallelism building blocks that run in one process: activation checkpointing, the
context-parallel layout, pipeline stage splitting. (The multi-process behaviour is proven by
tests/integration/test_parallel_parity.py.)"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.models.llama3 import Transformer, get_flavor
from trainer.parallel import local_runtime
from trainer.parallel.context_parallel import load_balanced_positions, shard_sequence
from trainer.parallel.pipeline import RankModel, split_into_stages
from trainer.parallel.stages import plan_stages


def tiny(seed: int = 0) -> Transformer:
    args = get_flavor("tiny")
    args.max_seq_len = 32
    model = Transformer(args)
    model.init_weights(seed)
    return model


class CountOps(TorchDispatchMode):
    """Counts the aten ops that really run (a recomputation cache hit does not reach this mode)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def train_once(model: Transformer) -> tuple[Counter, dict[str, torch.Tensor]]:
    """(ops run during backward, gradients) of one forward/backward."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    loss = model(tokens).logsumexp(-1).mean()
    with CountOps() as backward_ops:
        loss.backward()
    return backward_ops.counts, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_and_keeps_gradients():
    plain_ops, plain_grads = train_once(tiny())
    ops = {}
    for mode, option in (("full", "1"), ("selective", "2"), ("selective", "op")):
        model = tiny()
        model.apply_runtime(local_runtime(model, ac_mode=mode, ac_option=option))
        ops[option], grads = train_once(model)
        assert all(torch.allclose(grads[n], plain_grads[n], rtol=0, atol=1e-7) for n in grads), (mode, option)
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    extra = {option: {op: ops[option][op] - plain_ops[op] for op in ("mm", sdpa, "rsqrt")} for option in ops}
    assert plain_ops["rsqrt"] == 0  # no RMSNorm runs in a plain backward
    # Full: the forward of all 4 blocks runs again in backward: projections, attention, norms.
    matmuls_per_block = extra["1"]["mm"] // 4
    assert matmuls_per_block >= 6 and extra["1"] == {"mm": 4 * matmuls_per_block, sdpa: 4, "rsqrt": 8}
    # Every 2nd block (layers 0 and 2).
    assert extra["2"] == {"mm": 2 * matmuls_per_block, sdpa: 2, "rsqrt": 4}
    # Op-level: the matmul and attention outputs were kept; only the cheap ops run again.
    assert extra["op"] == {"mm": 0, sdpa: 0, "rsqrt": 8}


def test_selective_ac_uses_global_layer_indices_so_pipeline_stages_agree():
    stage = split_into_stages(tiny(), plan_stages(4, 2, "1F1B", None, 0, 0), pp_rank=1)[1]
    stage.apply_runtime(local_runtime(stage, ac_mode="selective", ac_option="2"))
    assert {name: block.runtime.recompute is not None for name, block in stage.layers.items()} == {"2": True, "3": False}


def test_load_balanced_positions_cover_the_sequence_evenly():
    cp, seq = 4, 32
    shards = [load_balanced_positions(r, cp, seq) for r in range(cp)]
    assert shards[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert shards[3].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    # Causal work (keys visible to each query) is the same on every rank.
    assert len({int((s + 1).sum()) for s in shards}) == 1


def test_shard_sequence_takes_the_rank_positions_of_every_row():
    batch = torch.arange(2 * 8).reshape(2, 8)
    assert shard_sequence(batch, 1, 2).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_stages_keep_original_parameter_names_and_rank_model_joins_them():
    model = tiny()
    names = dict(model.named_parameters())
    plan = plan_stages(4, 2, "Interleaved1F1B", None, 0, 0)
    with torch.device("meta"):
        meta = Transformer(model.args)
    stages = {rank: split_into_stages(meta, plan, rank) for rank in (0, 1)}
    assert sorted(stages[0]) == [0, 2] and sorted(stages[1]) == [1, 3]
    assert [n for n, _ in stages[0][0].named_parameters()][0] == "tok_embeddings.weight"
    assert list(stages[1][3].layers) == ["3"] and stages[1][3].output is not None
    owned = RankModel(list(stages[0].values()))
    assert [n for n, _ in owned.named_parameters()] == [
        n for n in names if n.startswith(("tok_embeddings", "layers.0.", "layers.2."))]
    every = {n for rank in (0, 1) for s in stages[rank].values() for n, _ in s.named_parameters()}
    assert every == set(names)


def test_a_stage_computes_what_the_same_layers_of_the_whole_model_compute():
    model = tiny(4)
    plan = plan_stages(4, 2, "1F1B", None, 1, 1)
    first, last = split_into_stages(model, plan, 0)[0], split_into_stages(model, plan, 1)[1]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    assert torch.equal(last(first(tokens)), model(tokens))
