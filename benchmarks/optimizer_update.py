"""CPU cost of the optimizer update on sharded parameters: torch's AdamW and clipping run through
DTensor, against the trainer's, which run the same kernels on each rank's local shards
(trainer/local_shards.py).

    python benchmarks/optimizer_update.py [--nproc 2] [--steps 5] [--layouts FSDP TP] [overrides ...]

For each layout, torchrun starts `nproc` ranks of this script. Each builds the real Trainer (its
parallelisms applied), takes one batch's gradients, then for each path in turn, on the same
parameters and gradients: a new optimizer whose first step creates its state (as the trainer's
build does), `steps` more steps, and the gradient clipping's scaling, once and `steps` times more.
Figures are CPU-seconds of the rank (time.process_time), the mean over ranks: the first call pays
what a process pays once (DTensor works out each foreach operation's sharding the first time it
meets a list of layouts), the later ones what every step pays. The local path runs first, so each
path's first call is the process's first of its kind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, machine, table  # noqa: I001 (sets sys.path)

LAYOUTS = {"FSDP": [], "TP": ["--parallelism.tensor_parallel_degree", "2"]}
BASE = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--checkpoint.no_enable", "--metrics.no_enable_tensorboard"]


def measure(call, repeats: int) -> tuple[float, float]:
    """CPU-seconds of the first call and the mean of `repeats` more."""
    start = time.process_time()
    call()
    first = time.process_time() - start
    start = time.process_time()
    for _ in range(repeats):
        call()
    return first, (time.process_time() - start) / max(repeats, 1)


def paths(trainer, steps: int) -> dict[str, dict[str, float]]:
    """path -> its figures, on this rank."""
    import torch

    from trainer.local_shards import scale_gradients_
    from trainer.optim import OPTIMIZERS, initialize_state

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    factor = torch.tensor(0.5)
    optimizers = {"local shards": OPTIMIZERS["AdamW"], "DTensor": torch.optim.AdamW}
    clips = {"local shards": lambda: scale_gradients_(grads, factor),
             "DTensor": lambda: torch.nn.utils.clip_grads_with_norm_(params, 1.0, factor, foreach=True)}
    figures = {}
    for name, optimizer_class in optimizers.items():
        optimizer = optimizer_class(params, lr=1e-4, foreach=True)
        start = time.process_time()
        initialize_state(optimizer)
        create = time.process_time() - start
        for p, g in zip(params, grads):  # initialize_state leaves no gradients
            p.grad = g
        _, step = measure(optimizer.step, steps)
        clip_first, clip = measure(clips[name], steps)
        figures[name] = {"first_step": create, "step": step, "clip_first": clip_first, "clip": clip}
    return figures


def worker(result: str, overrides: list[str], steps: int) -> None:
    import logging

    import torch.distributed as dist

    from trainer.config.manager import load_config
    from trainer.preflight.checks import plan_run
    from trainer.train import Trainer, configure_logging

    configure_logging()
    logging.getLogger().setLevel(logging.WARNING)
    config = load_config(overrides)
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    try:
        trainer.runner.forward_backward(trainer.loader.next_batch(), None)
        figures = paths(trainer, steps)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, figures)
        if trainer.rank == 0:
            Path(result).write_text(json.dumps(gathered))
    finally:
        trainer.close()


def run_layout(nproc: int, overrides: list[str], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
                   "--worker", str(result), "--steps", str(steps), "--", "--job.dump_folder", str(Path(tmp) / "run"),
                   *overrides]
        done = subprocess.run(command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(overrides)}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps (and clippings) after the first")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    if args.worker:
        worker(args.worker, [*BASE, *overrides], args.steps)
        return
    rows = []
    for layout in args.layouts:
        ranks = run_layout(args.nproc, [*LAYOUTS[layout], *overrides], args.steps)
        for path in ranks[0]:
            mean = {key: sum(rank[path][key] for rank in ranks) / len(ranks) for key in ranks[0][path]}
            rows.append([layout, path, f"{mean['first_step']:.3f}", f"{mean['step'] * 1e3:.1f}",
                         f"{mean['clip_first']:.3f}", f"{mean['clip'] * 1e3:.1f}"])
    print(f"{machine()}; {args.nproc} ranks, tiny model; CPU-seconds a rank (mean over ranks)")
    print(table(["layout", "update", "first step s", "later step ms", "first clipping s", "later clipping ms"], rows,
                "llrrrr"))


if __name__ == "__main__":
    from trainer.launch.process_exit import run_process

    run_process(main)  # a rank ends as the trainer's do (trainer/launch/process_exit.py)
