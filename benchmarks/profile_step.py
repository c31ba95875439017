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

from common import machine, synchronize, table  # noqa: I001 (sets sys.path)
from trainer.config.manager import load_config
from trainer.models.llama3.hf_config import configured_model_args
from trainer.models.llama3.args import flops_per_token
from trainer.optim import clip_grad_norm
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import run_process
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


def matmul_flops_per_s(device: torch.device, size: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """Sustained FLOP/s of one size x size matmul on `device` (the CPU: with torch's threads)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug_model.toml", help="training config (default debug_model.toml)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--top", type=int, default=12, help="operators to list")
    parser.add_argument("--trace", help="also write the profiled steps as a Chrome trace (JSON) to this file")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as dump:
        config = load_config(["--job.config_file", args.config, "--training.steps", str(2 * args.steps + 3),
                              "--job.dump_folder", dump, *overrides])
        trainer = Trainer(config, plan_run(config, 1))
        device = trainer.device
        steps = phases(trainer)
        for _ in range(3):  # warm up
            for _, run in steps:
                run()
        spent = dict.fromkeys((name for name, _ in steps), 0.0)
        for _ in range(args.steps):
            for name, run in steps:
                start = time.perf_counter()
                run()
                synchronize(device)
                spent[name] += time.perf_counter() - start
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                for _, run in steps:
                    run()
            synchronize(device)
        if args.trace:
            prof.export_chrome_trace(args.trace)
        trainer.close()

    total = sum(spent.values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{config.model.flavor}, batch {config.training.local_batch_size} x {config.training.seq_len}, "
          f"1 process, {where}, {args.steps} steps; {machine()}")
    rows = [[name, f"{1000 * t / args.steps:.2f}", f"{100 * t / total:.1f}"] for name, t in spent.items()]
    rows.append(["step", f"{1000 * total / args.steps:.2f}", "100.0"])
    print(table(["phase", "ms/step", "%"], rows))
    # On a GPU the operators are ranked by their kernels' time, on a CPU by their own host time.
    own = ((lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total))
    events = sorted(prof.key_averages(), key=lambda e: -own(e))[:args.top]
    profiled = sum(own(e) for e in prof.key_averages()) or 1
    print(table([f"operator (self {'device' if device.type == 'cuda' else 'CPU'} time)", "ms/step", "%", "calls/step"],
                [[e.key[:60], f"{own(e) / 1000 / args.steps:.2f}",
                  f"{100 * own(e) / profiled:.1f}", f"{e.count / args.steps:g}"] for e in events]))
    tokens = config.training.local_batch_size * config.training.seq_len
    shapes = configured_model_args(config.model)
    model_flops = flops_per_token(shapes, config.training.seq_len) * tokens * args.steps / total
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    peak = matmul_flops_per_s(device, size, dtype)
    if device.type == "cuda":
        print(f"peak memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved")
    print(f"model FLOP/s of the step {model_flops / 1e9:.1f} G; a {size} x {size} {str(dtype)[6:]} matmul here "
          f"{peak / 1e9:.1f} G; ratio {100 * model_flops / peak:.1f}%")


if __name__ == "__main__":
    run_process(main)  # the trainer ran gloo collectives here: see trainer.launch.process_exit
