"""Every collective of one training step, by op and dtype, over 2 gloo processes.

With bfloat16 parameters and `mixed_precision_reduce = "float32"`, no gradient is summed in
bfloat16: not FSDP's reduce-scatter, not TP's all-reduce of the (replicated) RMSNorm weights, not
CP's key/value gradient sums (they travel the ring inside CP's attention op, in the dtype the
layers are given here; tests/unit/test_ring_attention.py checks the messages themselves).
All-gathers of bf16 weights and activations, and TP's reduce-scatters of bf16 activations (their
sums are the forward's own output), are expected. Selective activation checkpointing (op) under
CP keeps the ring attention's outputs, so a step runs the ring as often as without checkpointing,
with the same gradients.

The model is the tiny Llama (4 layers, 4 heads, 2 KV heads), built and parallelized by
trainer.parallel.parallelize from a config, as the trainer does.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.collectives import CountCollectives
from tests.ranks import start_ranks
from trainer.launch.process_exit import exit_without_teardown

WORLD = 2
BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
AC_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
SCENARIOS = {
    "TP2 bf16": [*TP2, *BF16],
    "CP2 bf16": [*CP2, *BF16],
    "CP2": CP2,
    "CP2 AC op": [*CP2, *AC_OP],
}
ALL_GATHERS = {"all_gather_into_tensor", "_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"}


def one_step(overrides: list[str]) -> tuple[Counter, dict[str, torch.Tensor]]:
    """(collectives of one forward + backward, full gradients) of the tiny model under `overrides`."""
    from trainer.config.manager import load_config, with_default_config
    from trainer.models.llama3 import Transformer, get_flavor
    from trainer.parallel import parallelize
    from trainer.parallel.context_parallel import shard_sequence
    from trainer.parallel.dims import ParallelDims

    config = load_config(with_default_config(["--model.flavor", "tiny", "--training.seq_len", "32", *overrides]))
    dims = ParallelDims.from_config(config.parallelism, WORLD)
    mesh = dims.build_mesh("cpu")
    args = get_flavor("tiny")
    args.max_seq_len = 32
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims, mesh, config, torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(seed=0, device="cpu")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    if dims.cp > 1:
        tokens = shard_sequence(tokens, mesh["cp"].get_local_rank(), dims.cp)
    with CountCollectives() as log:
        model(tokens).float().logsumexp(-1).mean().backward()
    grads = {name: p.grad.full_tensor().float() for name, p in model.named_parameters()}
    cp_reduce = {block.attention.core.reduce_dtype for block in model.layers.values() if dims.cp > 1}
    return log.counts, grads, cp_reduce


def run_rank(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    for name, overrides in SCENARIOS.items():
        counts, grads, cp_reduce = one_step(overrides)
        if rank == 0:
            results[name] = (counts, grads)
            results[(name, "cp reduce dtype")] = cp_reduce
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """scenario name -> (collective counts, gradients) of rank 0."""
    with mp.Manager() as manager:
        results = manager.dict()
        init_file = tmp_path_factory.mktemp("reduction-dtypes") / "init"
        start_ranks(run_rank, (str(init_file), results), WORLD)
        return dict(results)


def reductions(counts: Counter) -> dict[tuple[str, str], int]:
    return {key: n for key, n in counts.items() if "reduce" in key[0]}


def show(name: str, counts: Counter) -> None:
    """The figures of docs/parallelisms_measurements.md and docs/performance_measurements.md (pytest -s prints them)."""
    collectives = sorted((key, n) for key, n in counts.items() if key[0] != "_wrap_tensor_autograd")  # not one
    print(f"{name}: " + ", ".join(f"{op} {dtype} x{n}" for (op, dtype), n in collectives))


def test_tp_reduces_the_norm_weight_gradients_in_float32(steps):
    counts, _ = steps["TP2 bf16"]
    show("TP2 bf16", counts)
    # One all-reduce per RMSNorm weight: 2 per block x 4 blocks + the final norm, all in float32.
    assert reductions(counts) == {("all_reduce", "float32"): 9,
                                  # bf16 activations: wo/w2 outputs in forward (8), gradients of the
                                  # sequence all-gathers before attention/FFN/output (9), embedding (1).
                                  ("reduce_scatter_tensor", "bfloat16"): 18}


def test_cp_sums_key_value_gradients_in_float32(steps):
    counts, _ = steps["CP2 bf16"]
    show("CP2 bf16", counts)
    # FSDP's 5 units (4 blocks + the root), in float32; CP reduces nothing by collective: one ring
    # op each way per layer, whose key/value gradient sums are float32.
    assert reductions(counts) == {("_reduce_scatter_base_", "float32"): 5}
    assert counts[("ring_attention", "bfloat16")] == 4 and counts[("ring_attention_backward", "bfloat16")] == 4
    assert steps[("CP2 bf16", "cp reduce dtype")] == {torch.float32}


def test_selective_ac_keeps_the_cp_ring_outputs(steps):
    (plain, plain_grads), (ac, ac_grads) = steps["CP2"], steps["CP2 AC op"]
    show("CP2", plain)
    show("CP2 AC op", ac)
    gathers = {name: sum(n for (op, _), n in counts.items() if op in ALL_GATHERS)
               for name, counts in (("plain", plain), ("ac", ac))}
    # FSDP: 5 units in forward + 4 re-gathered in backward (the last block stays); CP gathers nothing.
    assert gathers == {"plain": 9, "ac": 9}
    # One ring forward per layer: the recompute takes the kept outputs instead of a second ring.
    for counts in (plain, ac):
        assert counts[("ring_attention", "float32")] == 4 and counts[("ring_attention_backward", "float32")] == 4
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ac_grads[name], grad, rtol=0, atol=1e-6, msg=name)
