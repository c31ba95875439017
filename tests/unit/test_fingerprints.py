"""Per-module fingerprints (trainer/metrics/fingerprints.py) in one process: each figure against its
definition computed directly from the model, the float16 loss scale taken out, the steps chosen,
and the file kept with metrics.jsonl on resume; the blocks' branch figures counted once under
activation checkpointing and however two ranks hold a branch (sequence parts, DTensor shards,
replicas, partial sums), the same when the blocks are compiled, and naming the block of a bug
inside its attention. Their agreement across parallel layouts is checked by
tests/integration/test_parallel_parity.py and tests/integration/test_branch_fingerprints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.ranks import start_ranks
from trainer.records import run_meta
from trainer.config.manager import ConfigError, load_config, with_default_config
from trainer.metrics.fingerprints import FingerprintRecorder, is_recorded, parameter_names
from trainer.loss import cross_entropy_sum
from trainer.models.llama3 import Transformer, get_flavor
from trainer.optim import NormReduction
from trainer.parallel import local_runtime
from trainer.parallel.compile import set_memory_budget
from trainer.records.run_meta import BLOCK_QUANTITIES, BRANCH_QUANTITIES


def tiny_model() -> Transformer:
    args = get_flavor("tiny")
    model = Transformer(args)
    model.init_weights(seed=3)
    return model


def train_step(model: Transformer, recorder: FingerprintRecorder, tokens: torch.Tensor, scale: float | None,
               step: int = 1) -> None:
    """One step as the trainer takes it, over two microbatches, with the loss times `scale`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder.start()
    for rows in tokens.split(2):
        loss = cross_entropy_sum(model(rows[:, :-1]), rows[:, 1:]) / tokens[:, 1:].numel()
        (loss * (scale or 1.0)).backward()
    recorder.gradients(scale)
    for p in model.parameters():
        p.grad /= scale or 1.0
    optimizer.step()
    recorder.finish(step, skipped=False)


def keep_activations(model: Transformer, scale: float | None) -> dict[str, dict[str, list[torch.Tensor]]]:
    """quantity -> block -> every microbatch's tensor, whole, kept by hooks on the modules (not
    through the probe): each block's output and the gradient reaching it, and what its attention
    and its feed-forward return."""
    kept = {quantity: {} for quantity in (*BLOCK_QUANTITIES, *BRANCH_QUANTITIES)}

    def keeper(quantity, name):
        def hook(module, inputs, output):
            output = output[0] if isinstance(output, tuple) else output  # a block asked for its branches
            kept[quantity].setdefault(name, []).append(output.detach())
            if quantity == "output_rms":
                output.register_hook(lambda g: kept["grad_rms"].setdefault(name, []).append(g / (scale or 1.0)))
        return hook

    for name, block in model.layers.items():
        block.register_forward_hook(keeper("output_rms", name))
        block.attention.register_forward_hook(keeper("attention_rms", name))
        block.feed_forward.register_forward_hook(keeper("ffn_rms", name))
    return kept


def recorder_of(model: Transformer, folder) -> FingerprintRecorder:
    return FingerprintRecorder(model, [model], NormReduction(), parameter_names(model.args), model.args.n_layers,
                               first=4, every=0, folder=folder, device=torch.device("cpu"))


def record(tmp_path, scale: float | None) -> tuple[dict, dict]:
    """(the line the recorder wrote, the same figures computed directly) for one step."""
    torch.manual_seed(0)
    model = tiny_model()
    tokens = torch.randint(0, model.args.vocab_size, (4, 17))
    kept = keep_activations(model, scale)
    recorder = recorder_of(model, tmp_path)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_step(model, recorder, tokens, scale)
    line = json.loads((tmp_path / "fingerprints.jsonl").read_text())
    direct = {
        "grad_norm": {n: p.grad.double().norm().item() for n, p in model.named_parameters()},
        "update_norm": {n: (p.detach() - before[n]).double().norm().item() for n, p in model.named_parameters()},
        "param_norm": {n: p.detach().double().norm().item() for n, p in model.named_parameters()},
    }
    for quantity, blocks in kept.items():
        direct[quantity] = {n: torch.cat(v).double().square().mean().sqrt().item() for n, v in blocks.items()}
    return line, direct


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_each_figure_is_its_definition(tmp_path, scale):
    """Gradient, update and value norms per parameter; RMS of each block's output, of the
    gradient reaching it and of its attention and feed-forward branches over both microbatches;
    under a float16 loss scale, the unscaled figures."""
    line, direct = record(tmp_path, scale)
    assert line["step"] == 1 and line["skipped"] is False
    assert list(line["grad_norm"]) == [name for name, _ in tiny_model().named_parameters()]
    for quantity in (*BLOCK_QUANTITIES, *BRANCH_QUANTITIES):
        assert list(line[quantity]) == ["0", "1", "2", "3"], quantity
    for quantity, expected in direct.items():
        assert line[quantity].keys() == expected.keys(), quantity
        for entry, value in expected.items():
            assert value > 0, (quantity, entry)
            assert line[quantity][entry] == pytest.approx(value, rel=1e-6), (quantity, entry)


def test_the_probe_records_only_a_recorded_training_pass(tmp_path):
    model = tiny_model()
    recorder = recorder_of(model, tmp_path)
    tokens = torch.randint(0, model.args.vocab_size, (2, 9))
    model(tokens).sum().backward()  # not started: nothing counted
    assert recorder.probe.sums.abs().sum() == 0
    recorder.start()
    with torch.no_grad():  # an evaluation pass inside a recorded step counts nothing either
        model(tokens)
    assert recorder.probe.sums.abs().sum() == 0


ACTIVATIONS = ("output_rms", "grad_rms", *BRANCH_QUANTITIES)


def step_line(model: Transformer, folder, steps: int = 1) -> dict:
    """The fingerprints of `steps` recorded steps (the same batch each time), by block."""
    torch.manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (4, 17))
    folder.mkdir()
    recorder = recorder_of(model, folder)
    for step in range(1, steps + 1):
        train_step(model, recorder, tokens, None, step)
    return [json.loads(line) for line in (folder / "fingerprints.jsonl").open()]


@pytest.mark.parametrize("mode, option", [("full", "1"), ("selective", "op"), ("selective", "2")])
def test_a_recomputing_block_counts_once(tmp_path, mode, option):
    """Activation checkpointing runs a block's forward again in backward; the figures are those of
    the same model without it, not twice its sums of squares."""
    plain = step_line(tiny_model(), tmp_path / "plain")[0]
    model = tiny_model()
    model.apply_runtime(local_runtime(model, ac_mode=mode, ac_option=option))
    calls = {"n": 0}
    model.layers["0"].attention.register_forward_hook(lambda *_: calls.update(n=calls["n"] + 1))
    recomputed = step_line(model, tmp_path / "recomputed")[0]
    assert calls["n"] == 4  # 2 microbatches, each run in forward and again in backward
    for quantity in ACTIVATIONS:
        for block, value in plain[quantity].items():
            assert recomputed[quantity][block] == pytest.approx(value, rel=1e-12), (quantity, block)


@pytest.mark.parametrize("mode, option, backend", [
    ("none", "1", "aot_eager"), ("full", "1", "aot_eager"), ("selective", "op", "aot_eager"),
    ("memory_budget", "1", "aot_eager_decomp_partition")])
def test_compiled_blocks_record_the_same_figures_without_a_graph_break(tmp_path, mode, option, backend):
    """A compiled block hands its branches on as graph outputs at a recorded step (a second graph,
    no break); an unrecorded step between two recorded ones runs the first graph. Under every
    recomputation: full (an eager checkpoint around the graph), op-level (the checkpoint inside
    the graph) and the partitioner's memory budget (0.5). aot_eager: AOTAutograd's tracing with
    torch's kernels, so the figures equal eager's (inductor: tests/integration/test_branch_fingerprints.py)."""
    eager = step_line(tiny_model(), tmp_path / "eager")[0]
    torch._dynamo.reset()
    counters.clear()
    try:
        set_memory_budget(0.5 if mode == "memory_budget" else 1.0)
        model = tiny_model()
        model.apply_runtime(local_runtime(model, ac_mode=mode, ac_option=option, compile_backend=backend))
        first = step_line(model, tmp_path / "compiled")[0]
        graphs = counters["stats"]["unique_graphs"]
        torch.manual_seed(1)
        model(torch.randint(0, model.args.vocab_size, (2, 16))).sum().backward()  # not recorded
        assert counters["stats"]["unique_graphs"] == graphs + 1  # the graph without the branches
        model.zero_grad()
        step_line(model, tmp_path / "again")  # recorded again: no new graph
        assert counters["stats"]["unique_graphs"] == graphs + 1
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        set_memory_budget(1.0)
        torch._dynamo.reset()
    for quantity in ACTIVATIONS:
        for block, value in eager[quantity].items():
            assert first[quantity][block] == pytest.approx(value, rel=1e-6), (quantity, block)


def test_a_bug_inside_one_attention_names_its_block(tmp_path, monkeypatch):
    """The attention output of block 2 scaled by 1.01: that block's attention RMS moves by 1%, and
    every figure of the forward pass before it is unchanged (bit for bit)."""
    clean = step_line(tiny_model(), tmp_path / "clean")[0]
    model = tiny_model()
    attention = model.layers["2"].attention
    forward = attention.forward
    monkeypatch.setattr(attention, "forward", lambda *args, **kwargs: forward(*args, **kwargs) * 1.01)
    buggy = step_line(model, tmp_path / "buggy")[0]
    for block in ("0", "1"):
        for quantity in ("output_rms", *BRANCH_QUANTITIES):
            assert buggy[quantity][block] == clean[quantity][block], (quantity, block)
    assert buggy["attention_rms"]["2"] == pytest.approx(1.01 * clean["attention_rms"]["2"], rel=1e-6)
    assert buggy["output_rms"]["2"] != clean["output_rms"]["2"]


def _count_on_two_ranks(rank: int, folder: str) -> None:
    """Rank `rank` of 2: one (2, 8, 6) tensor handed to the probe as each rank may hold a branch's
    output; rank 0 writes the global sums of squares and counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from trainer.metrics.fingerprints import BlockProbe
    from trainer.launch.process_exit import exit_without_teardown

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(0))
    share = (0.25, 0.75)[rank]  # the partial sums of the two ranks add up to `full`
    held = {"plain sequence part": full.chunk(2, dim=1)[rank],
            "sequence-sharded DTensor": distribute_tensor(full, mesh, [Shard(1)]),
            "replicated DTensor": distribute_tensor(full, mesh, [Replicate()]),
            "partial DTensor": DTensor.from_local(full * share, mesh, [Partial()])}
    probe = BlockProbe(list(held), torch.device("cpu"))
    for row, tensor in enumerate(held.values()):
        probe._add(row, BlockProbe.ATTENTION, tensor)
    dist.all_reduce(probe.sums)
    if rank == 0:
        sums = probe.sums[:, BlockProbe.ATTENTION:BlockProbe.ATTENTION + 2].tolist()
        Path(folder, "sums.json").write_text(json.dumps({"full": full.double().square().sum().item(),
                                                         "held": dict(zip(held, sums))}))
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.mark.cores(2)
def test_each_element_of_a_branch_counts_once_however_the_ranks_hold_it(tmp_path):
    """A sequence part, a DTensor sharded, replicated, or of partial sums (added up first: the
    squares of the parts are not the square of their sum): the same global sum of squares."""
    start_ranks(_count_on_two_ranks, (str(tmp_path),), 2)
    found = json.loads((tmp_path / "sums.json").read_text())
    for kind, (squares, count) in found["held"].items():
        assert count == 2 * 8 * 6, kind
        assert squares == pytest.approx(found["full"], rel=1e-12), kind


def test_a_tied_model_names_its_one_weight_once():
    args = get_flavor("tiny")
    tied = type(args)(**{**args.__dict__, "tie_embeddings": True})
    names = parameter_names(tied)
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("first, every, recorded", [
    (4, 50, [1, 2, 3, 4, 50, 100]), (0, 30, [30, 60, 90]), (2, 0, [1, 2]), (0, 0, [])])
def test_recorded_steps(first, every, recorded):
    assert [s for s in range(1, 101) if is_recorded(s, first, every)] == recorded


def test_a_resume_keeps_the_fingerprints_of_the_steps_it_keeps(tmp_path):
    """fingerprints.jsonl follows metrics.jsonl: the lines after the resumed step move to previous/."""
    for name in run_meta.STEP_FILES:
        (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    moved = run_meta.drop_metrics_after(tmp_path, 2)
    for name in run_meta.STEP_FILES:
        assert [json.loads(line)["step"] for line in (tmp_path / name).open()] == [1, 2]
        assert [json.loads(line)["step"] for line in (moved / name).open()] == [3, 4]
    run_meta.archive(tmp_path)  # a new run in the folder: both go with the record
    assert not any((tmp_path / name).exists() for name in run_meta.STEP_FILES)


@pytest.mark.parametrize("key, value, message", [
    ("metrics.fingerprint_first", "-1", "metrics.fingerprint_first: must be >= 0, got -1"),
    ("metrics.fingerprint_every", "-5", "metrics.fingerprint_every: must be >= 0"),
])
def test_bad_steps_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(with_default_config([f"--{key}", value]))


def test_off_by_default():
    config = load_config(with_default_config([]))
    assert config.metrics.fingerprints is False


def test_fingerprints_that_record_no_step_are_refused():
    with pytest.raises(ConfigError, match="no step is recorded"):
        load_config(with_default_config(["--metrics.fingerprints", "--metrics.fingerprint_first", "0",
                                         "--metrics.fingerprint_every", "0"]))
