"""Per-rank model state under FSDP degree 1, 2, 4: parameters + gradients + optimizer state.

    python benchmarks/memory_scaling.py [--flavor 125M] [--degrees 1,2,4] [--seq-len 64] [--json FILE]

Trains the real trainer for two steps at each FSDP degree (1-D FSDP over all ranks, AdamW, fp32)
and prints, per degree, the bytes one rank holds for each kind of state (the largest over the
ranks), their total, that total as a fraction of the degree-1 total next to the ideal 1/N, and
the process's peak memory. FSDP2 shards every parameter along its first dimension, padded to a
multiple of N, so the fraction should sit at 1/N up to that padding.
"""

from __future__ import annotations

import argparse

from common import MIB, PEAK_MEMORY_NOTE, machine, run_training, table, write_json  # noqa: I001 (sets sys.path)


def measure(flavor: str, degree: int, seq_len: int) -> dict:
    reports = run_training(degree, [
        "--model.flavor", flavor, "--training.steps", "2", "--training.local_batch_size", "1",
        "--training.seq_len", str(seq_len), "--parallelism.data_parallel_shard_degree", "-1",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
    ])
    largest = max(reports, key=lambda r: sum(r["model_state"].values()))["model_state"]
    peak = max(next(iter(r["memory"].values())) for r in reports)
    baseline = max(next(iter(r["memory_before_model"].values())) for r in reports)
    return {"degree": degree, **largest, "total": sum(largest.values()), "peak_gib": peak, "baseline_gib": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="125M", help="model flavor (default 125M: 126M parameters)")
    parser.add_argument("--degrees", default="1,2,4", help="FSDP degrees (processes), comma separated")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (batch 1 per rank)")
    parser.add_argument("--json", help="also write the measured figures (bytes, GiB) to this file")
    args = parser.parse_args()

    results = [measure(args.flavor, int(n), args.seq_len) for n in args.degrees.split(",")]
    base = results[0]["total"] * results[0]["degree"]  # the whole state, held by one rank at degree 1
    rows = [[r["degree"], f"{r['params'] / MIB:,.1f}", f"{r['grads'] / MIB:,.1f}", f"{r['optimizer'] / MIB:,.1f}",
             f"{r['total'] / MIB:,.1f}", f"{r['total'] / base:.4f}", f"{1 / r['degree']:.4f}", f"{r['peak_gib']:.2f}", f"{r['baseline_gib']:.2f}"]
            for r in results]
    print(f"model state per rank, flavor {args.flavor}, AdamW fp32, FSDP over all ranks; {machine()}")
    print(table(["FSDP degree", "params MiB", "grads MiB", "optimizer MiB", "total MiB", "total / whole state",
                 "1/N", "peak memory GiB", "before the model GiB"], rows))
    print(f"Model state: exact bytes of the rank's local shards after the first optimizer step. {PEAK_MEMORY_NOTE}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
