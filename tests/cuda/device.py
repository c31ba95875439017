"""Run the trainer on the device under test, one process, through the launcher.

The device is never named in a configuration: the launcher (torchrun_launch.sh) trains on CUDA
when it sees a GPU and `trainer.process_setup.pick_device` takes the rank's GPU when torch sees one, else
the CPU. So a run is put on the CPU by hiding the GPUs (CUDA_VISIBLE_DEVICES=""), and on the
device under test (TRAINER_TEST_DEVICE) by leaving them visible.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tests.launch import LAUNCHER, REPO

DEVICE = os.environ.get("TRAINER_TEST_DEVICE", "")

# The debug model (~5.6M parameters) on the built-in synthetic source, 10 steps of batch 8 x 128.
# The warmup covers every step, so the learning rate of step s does not depend on
# training.steps: a run stopped and continued with more steps equals one run of all of them.
JOB = ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.local_batch_size", "8",
       "--training.steps", "10", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0",
       "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard"]
DETERMINISTIC = ["--debug.deterministic"]


def dtype_args(dtype: str) -> list[str]:
    """Compute dtype: FSDP's parameter dtype ("auto" is bfloat16 on CUDA, float32 on CPU, so the
    tests always name it)."""
    return ["--training.mixed_precision_param", dtype]


def device_env(device: str, **extra: str) -> dict:
    env = dict(os.environ, NGPU="1", PYTHON=sys.executable, LOG_RANK="0", PYTHONUNBUFFERED="1", **extra)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device == "cuda":
        if env.get("CUDA_VISIBLE_DEVICES") == "":
            raise RuntimeError("TRAINER_TEST_DEVICE=cuda, but CUDA_VISIBLE_DEVICES is empty (hides every GPU)")
    else:
        raise ValueError(f"device {device!r}: cpu or cuda")
    return env


def train(args: list[str], *, device: str = DEVICE, timeout: int = 420) -> subprocess.CompletedProcess:
    """One launcher run of one process on `device`."""
    return subprocess.run([str(LAUNCHER), *args], cwd=REPO, env=device_env(device), capture_output=True, text=True,
                          timeout=timeout)


def run_module(module: str, args: list[str], *, device: str = DEVICE,
               timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args` in one process on `device` (a world of one, no launcher)."""
    env = device_env(device, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def step_records(dump: Path) -> dict[int, dict]:
    """The last logged record of each training step (a continued run appends to metrics.jsonl)."""
    with open(dump / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r for r in records if "kind" not in r}


def losses(dump: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in step_records(dump).items()}


def run_record(dump: Path) -> dict:
    return json.loads((dump / "run_meta.json").read_text())


def peak_gib(memory: dict) -> float:
    """A run's peak memory: the CUDA allocator's peak allocation on GPUs, peak RSS on CPUs."""
    return memory.get("max_allocated_gib", memory.get("peak_rss_gib", float("nan")))


def median_speed(records: dict[int, dict]) -> tuple[float, float]:
    """(tokens/s, ms/step): medians over the logged steps after the first (which compiles, warms up)."""
    later = [r for step, r in sorted(records.items()) if step > 1] or list(records.values())
    return (statistics.median(r["tokens_per_s"] for r in later),
            1000 * statistics.median(r["step_time_s"] for r in later))


def all_finite(values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) for s in a)
