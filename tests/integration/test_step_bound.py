"""The preflight's lower bound of a step's activations (trainer/preflight/step_bound.py) against the
estimator (trainer.estimate, fake tensors) on the debug model at 2,048 tokens, where activations
dominate: the bound plus the weights never exceeds the estimated step peak, and comes within a
factor of two of it in every layout but pipeline parallelism (whose bound counts only the last
stage's logits). A step refused by the bound therefore cannot fit; the launcher refuses it in well
under a second."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.launch import REPO
from trainer.config.manager import load_config, with_default_config
from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.estimate.rank import rank_kinds
from trainer.parallel.dims import stage_plan
from trainer.preflight.checks import plan_layout
from trainer.preflight.step_bound import activation_bound

JOB = ["--training.seq_len", "2048", "--training.mixed_precision_param", "bfloat16"]
LAYOUTS = {
    "FSDP": [],
    "FSDP, float32 compute": ["--training.mixed_precision_param", "float32"],
    "FSDP, AC full": ["--activation_checkpoint.mode", "full"],
    "FSDP, AC selective": ["--activation_checkpoint.mode", "selective"],
    "TP": ["--parallelism.tensor_parallel_degree", "2"],
    "CP": ["--parallelism.context_parallel_degree", "2"],
    "PP": ["--parallelism.pipeline_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def estimates() -> dict:
    """layout -> (the bound's bytes, the estimator's largest step peak over rank kinds, its weights)."""
    found = {}
    for name, overrides in LAYOUTS.items():
        argv = [*JOB, *overrides]
        config, _ = estimated_config(argv)
        plan = plan_layout(config, 2)
        kinds = rank_kinds(plan.dims, stage_plan(config, plan.dims))
        peaks = [(e.step_peak.total, e.state.parameters) for e in estimate_kinds(argv, 2, kinds, steps=1)]
        bound = activation_bound(load_config(with_default_config(argv)), plan.dims.tp, plan.dims.cp, plan.dims.pp,
                                 "cuda")
        found[name] = (bound.bytes, *max(peaks))
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_bound_is_below_the_estimated_peak_and_within_a_factor_of_two(layout, estimates, measured):
    bound, peak, weights = estimates[layout]
    measured(f"step bound {layout:22s}: {bound / 2 ** 20:7.1f} MiB + weights {weights / 2 ** 20:.1f} MiB, "
             f"estimated step peak {peak / 2 ** 20:7.1f} MiB ({(bound + weights) / peak:.2f})")
    assert bound + weights <= peak
    if layout != "PP":
        assert bound + weights >= peak / 2


def test_a_step_that_cannot_fit_is_refused_before_any_process_starts():
    started = time.perf_counter()
    done = subprocess.run(["./torchrun_launch.sh", "--training.seq_len", "1000000"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert time.perf_counter() - started < 10 and done.returncode == 2, done.stderr
    assert "a step's activations (" in done.stderr and "8,000,000 tokens" in done.stderr
    assert "a shorter training.seq_len (above " in done.stderr and "[rank" not in done.stdout + done.stderr


def test_a_step_that_cannot_fit_a_gpu_is_refused_with_what_would_fit():
    from trainer.config.errors import ConfigError
    from trainer.preflight.step_bound import check_device_memory

    config = load_config(["--job.config_file", "llama3_8b.toml", "--training.seq_len", "131072"])
    dims = plan_layout(config, 8).dims  # FSDP over 8 GPUs of 80 GiB
    with pytest.raises(ConfigError, match=r"training.seq_len 131072, local_batch_size 1: a rank's step needs at least "
                                          r"15.0 GiB of model state and \d+.\d GiB of activations \(131,072 tokens\), "
                                          r"but its GPU has 80.0 GiB; use a shorter training.seq_len \(above "):
        check_device_memory(config, dims, 80 * 2 ** 30)
    check_device_memory(load_config(["--job.config_file", "llama3_8b.toml"]), dims, 80 * 2 ** 30)  # 8,192 tokens fit
    check_device_memory(config, dims, None)  # no nvidia-smi: nothing known, nothing refused
