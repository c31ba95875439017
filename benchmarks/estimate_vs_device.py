"""The estimator (python -m trainer.estimate) against a real run on this machine's device.

    python benchmarks/estimate_vs_device.py [--flavor 1B] [--seq-len 2048] [--local-batch 4] [--steps 2]

Estimates one rank of the job (a world of one, bfloat16 compute, eager), then trains the same job
for real for --steps steps in one process (benchmarks/common.run_training) and prints the
estimated peaks beside the measured one: on CUDA torch.cuda.max_memory_allocated over the run
(target: within 10% of the larger of the estimated init and step peaks); on a CPU the process's
peak RSS, which also holds Python, torch and the data pipeline (shown, not compared).
"""

from __future__ import annotations

import argparse
import time

from common import machine, run_training, table  # noqa: I001 (sets sys.path)

from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.estimate.rank import rank_kinds
from trainer.preflight.checks import plan_layout

GIB = float(1 << 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    job = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
           str(a.local_batch), "--training.mixed_precision_param", "bfloat16"]
    config, _ = estimated_config(job)
    started = time.perf_counter()
    [estimate] = estimate_kinds(job, 1, rank_kinds(plan_layout(config, 1).dims, None), steps=1)
    estimate_s = time.perf_counter() - started
    started = time.perf_counter()
    [report] = run_training(1, [*job, "--training.steps", str(a.steps), "--metrics.log_freq", "1"])
    real_s = time.perf_counter() - started
    memory = report["memory"]
    measured = memory.get("max_allocated_gib", memory.get("peak_rss_gib"))
    what = "CUDA max allocated" if "max_allocated_gib" in memory else "peak RSS (not comparable)"
    peak = estimate.peak / GIB
    print(machine())
    print(f"python benchmarks/estimate_vs_device.py --flavor {a.flavor} --seq-len {a.seq_len} "
          f"--local-batch {a.local_batch} --steps {a.steps}")
    print(table(["flavor", "state GiB", "est. init peak", "est. step peak", "est. peak", f"measured: {what}",
                 "difference", "estimate s", "real run s"],
                [[a.flavor, f"{estimate.state.total / GIB:.2f}", f"{estimate.init_peak.total / GIB:.2f}",
                  f"{estimate.step_peak.total / GIB:.2f}", f"{peak:.2f}", f"{measured:.2f}",
                  f"{100 * (peak / measured - 1):+.1f}%", f"{estimate_s:.0f}", f"{real_s:.0f}"]]))


if __name__ == "__main__":
    main()
