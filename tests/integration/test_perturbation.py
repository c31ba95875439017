"""A perturbed run starts from the same perturbed weights in every layout (the noise of a
parameter is drawn whole from its name and sharded like it), and only a new run is perturbed."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.launch import REPO, TINY_JOB, describe, read_metrics, run_many
from trainer.models.llama3 import Transformer, get_flavor

PERTURBED = ["--debug.init_perturbation", "8", "--debug.init_perturbation_seed", "3"]


def weights(tmp_path, name: str, nproc: int, extra: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter, whole, as the trainer starts with it under `nproc` processes."""
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "tests.workers.perturbed_weights", str(out), *TINY_JOB, "--job.dump_folder", str(tmp_path / name),
         *extra], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert result.returncode == 0, describe(result)
    return torch.load(out)


def initial_weights() -> dict[str, torch.Tensor]:
    """The tiny model's initial weights (debug.seed 0), which every layout starts from unperturbed."""
    args = get_flavor("tiny")
    args.max_seq_len = 32
    model = Transformer(args)
    model.init_weights(seed=0, device="cpu")
    return {name: p.detach() for name, p in model.named_parameters()}


def test_perturbed_weights_are_the_same_in_every_layout(tmp_path):
    plain = initial_weights()
    single = weights(tmp_path, "single", 1, PERTURBED)
    tp2 = weights(tmp_path, "tp2", 2, [*PERTURBED, "--parallelism.tensor_parallel_degree", "2"])
    assert single.keys() == tp2.keys() == plain.keys()
    for name in single:
        assert torch.equal(single[name], tp2[name]), name  # sharded by TP, perturbed identically
        change = (single[name] / plain[name] - 1).abs().max().item()
        if single[name].dim() >= 2:
            # 8 rounding errors of float32 (the CPU's compute dtype), plus the factor's and the product's rounding
            assert 0 < change <= 8 * 2 ** -24 + 2 ** -23, name
        else:
            assert change == 0, name


def test_a_resumed_run_is_not_perturbed_again(tmp_path):
    """The perturbation applies to the weights a run starts from; a resume continues trained
    weights: steps 6-10 trained again from the step-5 checkpoint are the steps trained the first time.
    The two runs one after the other in one process group (tests/workers/run_many.py)."""
    job = [*TINY_JOB, *PERTURBED, "--checkpoint.enable", "--checkpoint.interval", "5",
           "--job.dump_folder", str(tmp_path / "run")]
    found, _ = run_many(2, job, {"first": [], "again": ["--checkpoint.load_step", "5", "--checkpoint.overwrite"]},
                        tmp_path)
    first, again = found["first"], found["again"]
    assert "perturbed by up to" in first["log"], first["log"][-2000:]
    trained = [r["loss"] for r in first["metrics"]]
    assert "perturbed by up to" not in again["log"], again["log"][-2000:]
    assert "loaded" in again["log"] and [r["loss"] for r in read_metrics(tmp_path / "run")] == trained
