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


def run_many(nproc: int, base: list[str], runs: dict[str, list[str]], folder: Path, *, env: dict | None = None,
             timeout: int = 1200) -> tuple[dict, subprocess.CompletedProcess]:
    """Several training runs one after the other in one process group of `nproc` processes
    (tests/workers/run_many.py): name -> its results (metrics, rank 0's log, ...), and the
    process group's output. The start of torch is paid once, not once per run."""
    spec = {"base": base, "runs": [{"name": name, "overrides": overrides} for name, overrides in runs.items()]}
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "tests.workers.run_many", str(folder / "spec.json"), str(folder / "results.json")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert result.returncode == 0, describe(result)
    return json.loads((folder / "results.json").read_text()), result


def read_metrics(dump_folder: Path) -> list[dict]:
    with open(dump_folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def curve(dump_folder: Path) -> list[tuple[int, float, float]]:
    """Each training step's (step, loss, gradient norm), in file order: what two runs that must
    agree bitwise are compared by."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(dump_folder) if "kind" not in r]


def describe(result: subprocess.CompletedProcess) -> str:
    """A failed run's exit code and the ends of its output, and the first traceback of its stderr
    when the end leaves it out: the rank that failed first prints it, and torchrun's report of
    every rank's exit (several thousand characters) follows it."""
    text = f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    first = result.stderr.find("Traceback (most recent call last)")
    if 0 <= first < len(result.stderr) - 4000:
        text += f"\nthe first traceback of stderr:\n{result.stderr[first:first + 4000]}"
    return text


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
