"""Trainer overhead: steady-state tokens/s of the trainer vs a plain PyTorch loop, in one process.

    python benchmarks/overhead.py [--config debug_model.toml] [--block-steps 5] [--blocks 16]

Both loops live in this one process and take turns: a block of trainer steps, a block of plain
steps, then the other order (ABBA), so that drifts of the machine (clock, other load) hit both
alike. The trainer is the real one (`Trainer.run_until`: its data loader, loss accounting, global
gradient-norm clipping, LR schedule, metrics every `metrics.log_freq` steps, finiteness checks).
The plain loop is what one writes by hand: the same model class and initialization, AdamW with the
config's settings, the same batch shape (random tokens made before timing), mean cross-entropy,
`clip_grad_norm_`, a LambdaLR warmup. Prints tokens/s of each (over all timed blocks and the median
block) and the ratio trainer / plain, over all blocks and as the median of the ratios of adjacent
blocks (robust to a block slowed by the machine); >= 0.95 means the trainer costs at most 5% over
the hand-written loop.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from common import machine, table  # noqa: I001 (sets sys.path)
from trainer.config.manager import load_config
from trainer.models.llama3 import Transformer
from trainer.models.llama3.hf_config import configured_model_args
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import run_process
from trainer.train import Trainer


class PlainLoop:
    """A hand-written training loop of the same model, batch and optimizer."""

    def __init__(self, config, steps: int):
        args = configured_model_args(config.model)
        args.max_seq_len = config.training.seq_len
        with torch.device("meta"):
            self.model = Transformer(args)
        self.model.to_empty(device="cpu")
        self.model.init_weights(seed=config.debug.seed)
        o = config.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=o.implementation == "foreach",
                                           fused=o.implementation == "fused")
        warmup = max(config.lr_scheduler.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min((s + 1) / warmup, 1.0))
        self.max_norm = config.training.max_norm
        shape = (config.training.local_batch_size, config.training.seq_len + 1)
        generator = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, args.vocab_size, shape, generator=generator) for _ in range(steps)]
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            tokens = self.batches[self.step]
            self.step += 1
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            if self.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)


def timed(run, steps: int) -> float:
    start = time.perf_counter()
    run(steps)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug_model.toml", help="training config (default debug_model.toml)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per loop (even: ABBA order)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args, overrides = parser.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    total_steps = (args.blocks + 1) * args.block_steps  # + one warm-up block

    with tempfile.TemporaryDirectory() as dump:
        config = load_config(["--job.config_file", args.config, "--training.steps", str(total_steps),
                              "--job.dump_folder", dump, *overrides])
        trainer = Trainer(config, plan_run(config, 1))
        plain = PlainLoop(config, total_steps)
        run_trainer = lambda n: trainer.run_until(trainer.state.step + n)  # noqa: E731
        times: dict[str, list[float]] = {"trainer": [], "plain": []}
        timed(run_trainer, args.block_steps), timed(plain.run, args.block_steps)  # warm up both
        for block in range(args.blocks):
            order = [("trainer", run_trainer), ("plain", plain.run)]
            for name, run in order if block % 2 == 0 else order[::-1]:
                times[name].append(timed(run, args.block_steps))
        trainer.close()

    tokens = args.block_steps * config.training.local_batch_size * config.training.seq_len
    rows, rate = [], {}
    for name in ("plain", "trainer"):
        rate[name] = tokens * len(times[name]) / sum(times[name])
        median = tokens / statistics.median(times[name])
        rows.append([name, f"{rate[name]:,.0f}", f"{median:,.0f}",
                     f"{1000 * sum(times[name]) / (len(times[name]) * args.block_steps):.1f}"])
    b = config.training
    print(f"{config.model.flavor}, batch {b.local_batch_size} x {b.seq_len}, fp32, 1 process, "
          f"{torch.get_num_threads()} threads; {args.blocks} x {args.block_steps} steps each, alternating; {machine()}")
    print(table(["loop", "tokens/s (all blocks)", "tokens/s (median block)", "ms/step"], rows))
    paired = statistics.median(p / t for p, t in zip(times["plain"], times["trainer"]))
    print(f"trainer / plain tokens/s: {rate['trainer'] / rate['plain']:.3f} over all blocks, "
          f"{paired:.3f} as the median of adjacent block pairs")


if __name__ == "__main__":
    run_process(main)  # the trainer ran gloo collectives here: see trainer.launch.process_exit
