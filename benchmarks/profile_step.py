"""Where a trainer step spends its time, phase by phase, in one process.

    python benchmarks/profile_step.py [--config debug_model.toml] [--steps 20] [--top 12] [--section.key value ...]

Runs the trainer's step phases one by one (the same calls `Trainer.train_step` makes) with a
timer around each, then one more block of steps under torch.profiler, and prints the mean
milliseconds per phase and the operators with the most self time. What is neither matmul,
attention nor the optimizer's arithmetic is the trainer's own overhead. Last, it times a large
square matmul on this machine and sets the step's model FLOP/s (the trainer's FLOPs-per-token
formula) against it: an MFU measured against what the machine sustains, for devices whose peak
is not in a datasheet table (pass that figure as metrics.peak_flops to log MFU).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import machine, table  # noqa: I001 (sets sys.path)
from trainer.config.manager import load_config
from trainer.models.llama3.hf_config import configured_model_args
from trainer.models.llama3.args import flops_per_token
from trainer.optim import clip_grad_norm
from trainer.preflight import plan_run
from trainer.process_exit import run_process
from trainer.train import Trainer


def phases(trainer: Trainer):
    """The phases of Trainer.train_step, in order, as (name, callable) pairs sharing a dict."""
    cfg, box = trainer.config, {}
    return [
        ("data loader", lambda: box.update(batch=trainer.loader.next_batch())),
        ("forward + backward", lambda: trainer.runner.forward_backward(box["batch"])),
        ("gradient norm + clip", lambda: box.update(norm=clip_grad_norm(
            trainer.model.parameters(), cfg.training.max_norm, trainer.runner.norm_reduction()))),
        ("optimizer step", trainer.optimizer.step),
        ("LR schedule + zero_grad", lambda: (trainer.scheduler.step(), trainer.optimizer.zero_grad(set_to_none=True))),
        ("finiteness check", lambda: torch.isfinite(box["norm"]).item()),
    ]


def matmul_flops_per_s(size: int = 2048, repeats: int = 10) -> float:
    """Sustained float32 FLOP/s of one size x size matmul with torch's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug_model.toml", help="training config (default debug_model.toml)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--top", type=int, default=12, help="operators to list")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as dump:
        config = load_config(["--job.config_file", args.config, "--training.steps", str(2 * args.steps + 3),
                              "--job.dump_folder", dump, *overrides])
        trainer = Trainer(config, plan_run(config, 1))
        steps = phases(trainer)
        for _ in range(3):  # warm up
            for _, run in steps:
                run()
        spent = dict.fromkeys((name for name, _ in steps), 0.0)
        for _ in range(args.steps):
            for name, run in steps:
                start = time.perf_counter()
                run()
                spent[name] += time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                for _, run in steps:
                    run()
        trainer.close()

    total = sum(spent.values())
    print(f"{config.model.flavor}, batch {config.training.local_batch_size} x {config.training.seq_len}, "
          f"1 process, {torch.get_num_threads()} threads, {args.steps} steps; {machine()}")
    rows = [[name, f"{1000 * t / args.steps:.2f}", f"{100 * t / total:.1f}"] for name, t in spent.items()]
    rows.append(["step", f"{1000 * total / args.steps:.2f}", "100.0"])
    print(table(["phase", "ms/step", "%"], rows))
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
    profiled = sum(e.self_cpu_time_total for e in prof.key_averages())
    print(table(["operator (self time)", "ms/step", "%", "calls/step"],
                [[e.key[:60], f"{e.self_cpu_time_total / 1000 / args.steps:.2f}",
                  f"{100 * e.self_cpu_time_total / profiled:.1f}", f"{e.count / args.steps:g}"] for e in events]))
    tokens = config.training.local_batch_size * config.training.seq_len
    shapes = configured_model_args(config.model)
    model_flops = flops_per_token(shapes, config.training.seq_len) * tokens * args.steps / total
    peak = matmul_flops_per_s()
    print(f"model FLOP/s of the step {model_flops / 1e9:.1f} G; a 2048 x 2048 float32 matmul here "
          f"{peak / 1e9:.1f} G; ratio {100 * model_flops / peak:.1f}%")


if __name__ == "__main__":
    run_process(main)  # the trainer ran gloo collectives here: see trainer.process_exit
