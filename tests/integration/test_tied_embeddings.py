"""A tied model (output layer = token embedding, as Llama 3.2) trains alike under FSDP, TP and PP.

The model is the tiny Llama with tied embeddings, built with model.flavor = "hf" from a
config.json (tie_word_embeddings = true), as a user's Llama 3.2 folder would be. Under pipeline
parallelism the first and the last stage each hold a copy of the tied weight; their gradients
are summed after backward and the global norm counts the weight once (trainer/parallel/tied.py).
Without the sum the PP run's step-1 gradient norm is 1.185 instead of 1.471 and the step-2 loss
differs by 1.4e-2, so the parity targets below catch it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import describe, launch, read_metrics, run_many
from trainer.checkpoint.dcp_read import read_model_state, saved_keys
from trainer.models.llama3 import get_flavor
from trainer.models.llama3.hf_config import hf_config

STEPS = 6
LAYOUTS = {
    "FSDP dp2": (2, []),
    "1 process": (1, ["--training.local_batch_size", "8"]),  # the model runs unwrapped (no FSDP)
    "FSDP+TP2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "FSDP+PP2 Interleaved1F1B": (4, ["--parallelism.pipeline_parallel_degree", "2",
                                     "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied-assets")
    args = get_flavor("tiny")
    args.tie_embeddings = True
    (folder / "config.json").write_text(json.dumps(hf_config(args)))
    return folder


def job(assets) -> list[str]:
    return ["--model.flavor", "hf", "--model.hf_assets_path", str(assets), "--training.seq_len", "32",
            "--training.steps", str(STEPS), "--training.local_batch_size", "4", "--optimizer.lr", "3e-3",
            "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
            "--metrics.no_enable_tensorboard", "--debug.deterministic"]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The seed, and each layout's dump folder. The layouts of 4 processes run one after the other
    in one process group (tests/workers/run_many.py); the others through the launcher."""
    seed_dump = tmp_path_factory.mktemp("tied-seed")
    result = launch(1, [*job(assets), "--job.dump_folder", str(seed_dump), "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 0, describe(result)
    seed = seed_dump / "checkpoint" / "step-0"
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed)]
    dumps = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        if nproc != 4:
            dump = tmp_path_factory.mktemp("tied-run")
            result = launch(nproc, [*job(assets), *overrides, *load, "--job.dump_folder", str(dump)])
            assert result.returncode == 0, describe(result)
            dumps[name] = dump
    shared = {name: [*overrides, *load] for name, (nproc, overrides) in LAYOUTS.items() if nproc == 4}
    folder = tmp_path_factory.mktemp("tied-runs")
    found, _ = run_many(4, job(assets), shared, folder)
    for name in shared:
        assert f"loaded model from {seed}" in found[name]["log"], found[name]["log"][-2000:]
        dumps[name] = Path(found[name]["dump"])
    return seed, dumps


def curves(dump) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(dump) if "loss" in r}


@pytest.mark.parametrize("name", ["1 process", "FSDP+TP2", "FSDP+PP2 Interleaved1F1B"])
def test_tied_model_trains_like_the_fsdp_control(name, runs):
    _, dumps = runs
    control, test = curves(dumps["FSDP dp2"]), curves(dumps[name])
    assert sorted(test) == sorted(control) == list(range(1, STEPS + 1))
    loss_diffs = [abs(test[s][0] - control[s][0]) for s in control]
    norm_rel = abs(test[1][1] - control[1][1]) / control[1][1]
    print(f"{name}: step-1 |loss diff| {loss_diffs[0]:.2e}, max {max(loss_diffs):.2e}, "
          f"step-1 grad-norm rel diff {norm_rel:.2e}")
    assert loss_diffs[0] <= 1e-5 and max(loss_diffs) <= 1e-4  # ARCHITECTURE.md parity targets
    assert norm_rel <= 1e-5  # the tied weight's gradient counted once, whole
    assert all(abs(test[s][1] - control[s][1]) <= 1e-5 * control[s][1] for s in control)


def test_tied_checkpoints_hold_the_weight_once_under_its_parameter_name(runs):
    """Every layout saves tok_embeddings.weight and no output.weight; the PP run's two stage
    copies are written under that one key, and its weights end where the control's do."""
    seed, dumps = runs
    for path in [seed, *(dump / "checkpoint" / f"step-{STEPS}" for dump in dumps.values())]:
        keys = saved_keys(path)
        assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys, path
    control = read_model_state(dumps["FSDP dp2"] / "checkpoint" / f"step-{STEPS}")
    piped = read_model_state(dumps["FSDP+PP2 Interleaved1F1B"] / "checkpoint" / f"step-{STEPS}")
    assert control.keys() == piped.keys()
    diff = max((control[k] - piped[k]).abs().max().item() for k in control)
    assert diff <= 1e-5, diff
    assert not torch.equal(control["tok_embeddings.weight"], read_model_state(seed)["tok_embeddings.weight"])
