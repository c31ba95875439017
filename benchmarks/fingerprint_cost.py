"""What per-module fingerprints (metrics.fingerprints) cost a training step, in one process.

    python benchmarks/fingerprint_cost.py [--config debug_model.toml] [--block-steps 4] [--blocks 12]
                                          [--run-steps 1000] [--clock wall|cpu] [trainer overrides]

One real Trainer (its loader, loss, clipping, optimizer, metrics) takes turns in three modes, a
block of steps each, the order rotating from block to block so that drifts of the machine hit all
alike:
    off        no recorder and no probe on the model: plain training
    idle       fingerprints on, at a step that is not recorded (the probe is installed, inactive)
    recorded   every step recorded (sums of squares, a copy of the parameters for the update,
               one all-reduce, one line of fingerprints.jsonl)
Prints ms/step of each (median block) and the cost of a run of --run-steps steps at the default
frequency (metrics.fingerprint_first / fingerprint_every): idle steps plus the recorded ones, as
a share of the same run without fingerprints. `--clock cpu` times the CPU seconds of this process
instead of the wall clock: on a machine other jobs share (with OMP_NUM_THREADS=1), what the steps
compute, without the time they wait for a core.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

from common import machine, table  # noqa: I001 (sets sys.path)
from trainer.config.manager import load_config
from trainer.metrics.fingerprints import is_recorded
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import run_process
from trainer.train import Trainer

MODES = ("off", "idle", "recorded")


def set_mode(trainer: Trainer, recorder, mode: str) -> None:
    """Switch the one trainer between the modes (see the module docstring)."""
    trainer.metrics.fingerprints = None if mode == "off" else recorder
    for module in trainer.model.modules():
        if hasattr(module, "attach_probe"):
            module.attach_probe(None if mode == "off" else recorder.probe)
    if recorder is not None:
        recorder.first, recorder.every = (1 << 30, 0) if mode == "recorded" else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug_model.toml", help="training config (default debug_model.toml)")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=12, help="timed blocks per mode")
    parser.add_argument("--run-steps", type=int, default=1000, help="the run length the default frequency is costed over")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time (default), or this process's CPU time (a shared machine)")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    total_steps = (len(MODES) * (args.blocks + 1)) * args.block_steps
    with tempfile.TemporaryDirectory() as dump:
        config = load_config(["--job.config_file", args.config, "--training.steps", str(total_steps),
                              "--job.dump_folder", dump, "--metrics.fingerprints", "--metrics.log_freq", "1000000",
                              *overrides])
        first, every = config.metrics.fingerprint_first, config.metrics.fingerprint_every
        trainer = Trainer(config, plan_run(config, 1))
        recorder = trainer.metrics.fingerprints
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for block in range(args.blocks + 1):  # the first round warms up and is not kept
            for mode in MODES[block % 3:] + MODES[:block % 3]:
                set_mode(trainer, recorder, mode)
                start = clock()
                trainer.run_until(trainer.state.step + args.block_steps)
                if block:
                    times[mode].append((clock() - start) / args.block_steps)
        trainer.close()

    step = {mode: statistics.median(values) for mode, values in times.items()}
    recorded_steps = sum(is_recorded(s, first, every) for s in range(1, args.run_steps + 1))
    with_prints = (args.run_steps - recorded_steps) * step["idle"] + recorded_steps * step["recorded"]
    without = args.run_steps * step["off"]
    b = config.training
    print(f"{config.model.flavor}, batch {b.local_batch_size} x {b.seq_len}, 1 process, {torch.get_num_threads()} "
          f"threads; {args.blocks} blocks x {args.block_steps} steps per mode, rotating; {args.clock} clock; {machine()}")
    print(table(["mode", "ms/step (median block)", "vs off"],
                [[mode, f"{1000 * step[mode]:.1f}", f"{step[mode] / step['off'] - 1:+.1%}"] for mode in MODES]))
    print(f"a {args.run_steps}-step run at fingerprint_first = {first}, fingerprint_every = {every} records "
          f"{recorded_steps} steps: {with_prints / without - 1:+.2%} time over the same run without fingerprints")


if __name__ == "__main__":
    run_process(main)
