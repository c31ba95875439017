"""Resident memory of rank 0 after each phase of the first training steps, on CPU.

    python benchmarks/memory_phases.py [--nproc 2] [--flavor 125M] [--steps 2]

Starts `--nproc` processes with torchrun; each builds the real trainer (FSDP over all ranks when
nproc > 1), then runs the phases of `Trainer.train_step` one by one. After each phase rank 0 reads
its current resident set (VmRSS) and its high-water mark (VmHWM) from /proc/self/status and the
table shows both. Comparing nproc 1 and 2 shows where the part of the peak that FSDP does not
shard comes from. Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import REPO, machine, table  # noqa: I001 (sets sys.path)

GIB_IN_KIB = float(1 << 20)


def resident_gib() -> tuple[float, float]:
    """(current resident set, its high-water mark) of this process in GiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / GIB_IN_KIB
    return values["VmRSS"], values["VmHWM"]


def worker(flavor: str, steps: int) -> None:
    import logging

    from trainer.config.manager import load_config
    from trainer.optim import clip_grad_norm
    from trainer.preflight.checks import plan_run
    from trainer.train import Trainer, configure_logging

    configure_logging()
    logging.getLogger().setLevel(logging.WARNING)  # the table only
    config = load_config([
        "--model.flavor", flavor, "--training.steps", str(steps), "--training.local_batch_size", "1",
        "--training.seq_len", "64", "--parallelism.data_parallel_shard_degree", "-1",
        "--lr_scheduler.warmup_steps", "1", "--metrics.no_enable_tensorboard",
        "--job.dump_folder", os.environ["MEMORY_PHASES_DUMP"],
    ])
    rows = [["start", *resident_gib()]]
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    rows.append(["model built", *resident_gib()])
    for step in range(1, steps + 1):
        trainer.runner.forward_backward(trainer.loader.next_batch())
        rows.append([f"step {step}: forward + backward", *resident_gib()])
        clip_grad_norm(trainer.model.parameters(), config.training.max_norm, trainer.runner.norm_reduction())
        trainer.optimizer.step()
        rows.append([f"step {step}: clip + optimizer step", *resident_gib()])
        trainer.optimizer.zero_grad(set_to_none=True)
        rows.append([f"step {step}: zero_grad", *resident_gib()])
    if trainer.rank == 0:
        print(table(["after", "resident GiB", "high-water GiB"],
                    [[name, f"{rss:.2f}", f"{hwm:.2f}"] for name, rss, hwm in rows]), flush=True)
    trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (FSDP degree), default 2")
    parser.add_argument("--flavor", default="125M", help="model flavor (default 125M)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, PYTHONPATH=str(REPO), MEMORY_PHASES_DUMP=dump)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--worker", args.flavor, str(args.steps)]
        print(f"rank 0 of {args.nproc} process(es), flavor {args.flavor}, batch 1 x 64, fp32 AdamW; {machine()}",
              flush=True)
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        print(done.stdout, end="")
        if done.returncode != 0:
            sys.exit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        from trainer.launch.process_exit import run_process

        run_process(lambda: worker(sys.argv[2], int(sys.argv[3])))
    else:
        main()
