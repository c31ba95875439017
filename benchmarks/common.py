"""What the benchmark scripts share: running the real trainer in torchrun workers and measuring
what each rank holds, and printing tables.

A benchmark script calls `run_training(nproc, overrides)` in its main process. That starts
`torchrun ... benchmarks/common.py --result FILE overrides` and each worker builds the real
`Trainer` from the overrides, trains, and reports per rank:

* model state: bytes of this rank's parameters, gradients and optimizer state, measured right
  after the first optimizer step (when all three exist), from the tensors' local shards;
* peak memory: CUDA allocator peak on GPUs, peak RSS of the process elsewhere, and the same
  figure before the model was built (what torch, the process group and Python take alone);
* the trainer's own figures from metrics.jsonl (loss, step time), written by rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = float(1 << 20)
GIB = float(1 << 30)
PEAK_MEMORY_NOTE = ("Peak memory: CUDA max allocated on GPUs, process peak RSS on CPUs (largest rank); the same "
                    "figure taken before the model was built is what torch and the process group hold alone.")


def synchronize(device) -> None:
    """Wait for the device's queued work (a CUDA GPU's kernels run after their launch returns)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def model_state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    import torch

    from trainer.estimate.rank import local_bytes

    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor) and value.dim() > 0]  # not Adam's scalar step counts
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in state),
    }


def run_training(nproc: int, overrides: list[str], timeout: int = 1800) -> list[dict]:
    """Train with the real trainer on `nproc` processes; returns one report per rank."""
    from trainer.config.manager import ConfigError, load_config
    from trainer.preflight.checks import plan_run

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        args = ["--job.dump_folder", str(Path(tmp) / "run"), "--metrics.no_enable_tensorboard", *overrides]
        try:  # a bad option: one message now, not one traceback per worker
            plan_run(load_config(args), nproc)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   __file__, "--result", str(result), *args]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{nproc}-process run {' '.join(overrides)} failed:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def _worker(result_path: str, overrides: list[str]) -> None:
    import faulthandler
    import logging

    import torch.distributed as dist

    from trainer.config.manager import load_config
    from trainer.metrics.step_log import memory_stats
    from trainer.preflight.checks import plan_run
    from trainer.train import Trainer, configure_logging

    faulthandler.enable(file=sys.__stderr__)  # a native crash still shows where Python was
    configure_logging()
    logging.getLogger().setLevel(logging.WARNING)
    config = load_config(overrides)
    before_model = memory_stats(torch_device())
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    measured: dict[str, int] = {}

    def after_first_step(optimizer, *_):
        if not measured:
            measured.update(model_state_bytes(trainer.model, optimizer))

    trainer.optimizer.register_step_post_hook(after_first_step)
    try:
        trainer.train()
        report = {"rank": trainer.rank, "model_state": measured, "memory": memory_stats(trainer.device),
                  "memory_before_model": before_model}
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if trainer.rank == 0:
            metrics = [json.loads(line) for line in open(Path(config.job.dump_folder) / "metrics.jsonl")]
            steps = [r for r in metrics if "kind" not in r]
            reports[0]["metrics"] = steps
            Path(result_path).write_text(json.dumps(reports))
    finally:
        trainer.close()


def torch_device():
    from trainer import process_setup

    return process_setup.pick_device()


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` has one 'l' or 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":" if a == "r" else ":" + "-" * (w + 1)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def write_json(path: str | None, results: list[dict]) -> None:
    """The measured figures (bytes, seconds, GiB) as JSON, when a path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def cpu_model() -> str:
    """The CPU's model name on Linux, else empty."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine() -> str:
    """One line describing where the figures were measured."""
    import platform

    import torch

    if torch.cuda.is_available():
        where = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        where = f"CPU ({cpu_model() or platform.machine()}, {os.cpu_count()} cores)"
    return f"{where}, torch {torch.__version__}, Python {platform.python_version()}"


def _worker_main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "--result":
        sys.exit("usage (started by torchrun from run_training): common.py --result FILE [--section.key value ...]")
    _worker(sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    from trainer.launch.process_exit import run_process

    run_process(_worker_main)


def generated_jsonl_corpus(folder: Path, text_mb: float, names: list[str]) -> list[Path]:
    """jsonl files of generated English-like sentences, text_mb MB in all, under `folder`
    (reused when present): the text the data benchmarks tokenize."""
    from tests.unit.test_tokenizer import sentences

    paths = [folder / name for name in names]
    if all(path.is_file() for path in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    documents = sentences(20_000, seed=1)
    per_file = int(text_mb * 2**20 / len(paths))
    for index, path in enumerate(paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            written, i = 0, index
            while written < per_file:
                line = json.dumps({"text": " ".join(documents[(i + k) % len(documents)] for k in range(8))}) + "\n"
                f.write(line)
                written, i = written + len(line), i + 8
    return paths


def generated_tokenizer(folder: Path) -> Path:
    """A 512-piece SentencePiece model of the same sentences, under `folder` (reused when present)."""
    from tests.unit.test_tokenizer import sentences
    from trainer.data.tokenizer import train_tokenizer

    model = folder / "tok.model"
    if not model.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tok.txt").write_text("\n".join(sentences(5000, seed=2)) + "\n")
        train_tokenizer([str(folder / "tok.txt")], str(folder / "tok"), 512)
    return model

