"""training.dtype = "bfloat16" over 2 gloo processes: parameters, gradients and Adam state in
bfloat16 (no float32 copy), every gradient reduction still in float32, and a loss that tracks
the float32 run's to bfloat16 rounding."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tests.collectives import CountCollectives
from tests.launch import TINY_JOB, run_many
from tests.ranks import start_ranks
from trainer.config.saved_config import HEADER
from trainer.launch.process_exit import exit_without_teardown

WORLD = 2
STEPS = ["--training.steps", "3"]


def test_bfloat16_training_tracks_float32_with_bfloat16_state(tmp_path):
    # The two runs one after the other in one process group (tests/workers/run_many.py).
    found, _ = run_many(WORLD, [*TINY_JOB, *STEPS, "--checkpoint.enable", "--checkpoint.no_last_save_model_only",
                                "--job.save_config_file", "config.toml"],
                        {dtype: ["--training.dtype", dtype] for dtype in ("float32", "bfloat16")}, tmp_path)
    runs = {dtype: [r["loss"] for r in result["metrics"]] for dtype, result in found.items()}
    dump = Path(found["bfloat16"]["dump"])
    full, half = runs["float32"], runs["bfloat16"]
    print(f"losses of 3 steps: float32 {full}, bfloat16 {half}")
    assert len(half) == 3 and all(math.isfinite(loss) for loss in half)
    assert half[0] > half[1] > half[2]
    # Measured differences 1e-4 to 1.5e-3: bfloat16 rounding of weights, activations and updates.
    assert max(abs(a - b) for a, b in zip(full, half)) < 5e-3

    # The last checkpoint holds what the run trained: weights and both Adam moments in bfloat16.
    metadata = dcp.FileSystemReader(str(dump / "checkpoint" / "step-3")).read_metadata()
    dtypes = Counter()
    for key, item in metadata.state_dict_metadata.items():
        kind = "model" if key.startswith("model.") else key.rsplit(".", 1)[-1]
        if kind in ("model", "exp_avg", "exp_avg_sq"):
            dtypes[(kind, item.properties.dtype)] += 1
    parameters = 4 * 9 + 3  # 4 blocks of 9 tensors, embedding, final norm, output
    assert dtypes == {("model", torch.bfloat16): parameters, ("exp_avg", torch.bfloat16): parameters,
                      ("exp_avg_sq", torch.bfloat16): parameters}

    # job.save_config_file: rank 0 wrote the resolved configuration of the run.
    saved = (dump / "config.toml").read_text()
    assert saved.startswith(HEADER + "\n[job]\n")
    assert 'dtype = "bfloat16"' in saved and 'mixed_precision_param = "bfloat16"' in saved


def one_step() -> dict:
    """Rank's view of one forward and backward of the tiny model in full bfloat16 under FSDP, built
    as the trainer builds it (trainer.train.Trainer._build_model)."""
    from trainer.config.manager import load_config, with_default_config
    from trainer.models.llama3 import Transformer, get_flavor
    from trainer.parallel import parallelize
    from trainer.parallel.dims import ParallelDims
    from trainer.parallel.fsdp import DTYPES, apply_fsdp, parameters_in

    config = load_config(with_default_config(["--model.flavor", "tiny", "--training.seq_len", "32",
                                              "--training.dtype", "bfloat16"]))
    dims = ParallelDims.from_config(config.parallelism, WORLD)
    mesh = dims.build_mesh("cpu")
    args = get_flavor("tiny")
    args.max_seq_len = 32
    with torch.device("meta"), parameters_in(DTYPES[config.training.dtype]):
        model = Transformer(args)
    parallelize(model, dims, mesh, config, torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(seed=0, device="cpu")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CountCollectives() as log:
        logits = model(tokens[:, :-1])
        logits.float().logsumexp(-1).mean().backward()
    with torch.device("meta"), parameters_in(torch.bfloat16):
        another = Transformer(args)
    try:
        apply_fsdp(another, mesh["dp_shard_cp"], param_dtype=torch.float32, reduce_dtype=torch.float32,
                   reshard_after_forward=True)
        upcast_refused = ""
    except ValueError as e:
        upcast_refused = str(e)
    return {"collectives": log.counts, "logits": logits.dtype, "upcast_refused": upcast_refused,
            "parameters": {p.to_local().dtype for p in model.parameters()},
            "gradients": {p.grad.to_local().dtype for p in model.parameters()}}


def run_rank(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results[rank] = one_step()
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        init_file = tmp_path_factory.mktemp("bfloat16") / "init"
        start_ranks(run_rank, (str(init_file), results), WORLD)
        return results[0]


@pytest.mark.smoke
def test_fsdp_neither_upcasts_the_parameters_nor_reduces_in_bfloat16(step):
    assert step["parameters"] == {torch.bfloat16} and step["gradients"] == {torch.bfloat16}
    assert step["logits"] == torch.bfloat16
    by_dtype = Counter()
    for (op, dtype), calls in step["collectives"].items():
        by_dtype[("reduce" if "reduce" in op else "gather" if "gather" in op else op, dtype)] += calls
    print("collectives of one full-bfloat16 step:", dict(step["collectives"]))
    # 5 FSDP units (4 blocks, the root): all-gathered in bfloat16 as stored (no float32 copy) in
    # forward, again in backward but for the last block; gradients reduce-scattered in float32.
    assert by_dtype == {("gather", "bfloat16"): 9, ("reduce", "float32"): 5}
    assert step["upcast_refused"] == "FSDP would cast ['torch.bfloat16'] parameters up to torch.float32 for compute"
