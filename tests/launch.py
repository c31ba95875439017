"""Run the launcher from tests and read what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "torchrun_launch.sh"

# A tiny, fully deterministic job: the base of the multi-process tests.
TINY_JOB = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "10",
    "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard", "--debug.deterministic",
]


def launch(nproc: int, args: list[str], *, cwd: Path | None = None, timeout: int = 300,
           log_rank: str = "0") -> subprocess.CompletedProcess:
    # The tests run on CPUs with gloo, also on a machine with GPUs.
    env = dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable, LOG_RANK=log_rank, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([str(LAUNCHER), *args], cwd=cwd or REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(dump_folder: Path) -> list[dict]:
    with open(dump_folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc (Linux): torchrun's and the launcher's ranks live in
    their own process groups, so killing a run means finding them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
