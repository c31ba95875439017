"""Data-parallel strategies side by side: time per step, memory per rank, loss after K steps.

    python benchmarks/strategies.py [--flavor 125M] [--nproc 4] [--steps 6] [--seq-len 128] [--only NAMES]
                                    [--ac none,full] [--json FILE]

Runs the real trainer once per strategy, each without and with full activation checkpointing,
all on the same number of processes, the same global batch (local batch 1 per rank) and the same
seed, and prints one row per run:

  DDP                  every rank holds everything; gradients all-reduced
  FSDP (reshard)       parameters, gradients, optimizer state sharded; parameters freed again
                       after forward and re-gathered for backward (ZeRO-3-like)
  FSDP (no reshard)    as FSDP, but the gathered parameters stay from forward to backward
                       (ZeRO-2-like: one all-gather per step instead of two)
  HSDP                 sharded within groups of nproc/2 ranks, replicated across 2 groups
  FSDP + CPU offload   sharded state kept in host memory, copied to the device per use
                       (needs GPUs: on a CPU the state is in host memory already, so the row
                       says so instead of timing a no-op)

Time per step is the trainer's own (metrics.jsonl) mean over steps 2..K, so start-up and the
first step stay out. The losses agree across strategies: they compute the same thing.
"""

from __future__ import annotations

import argparse

from common import MIB, PEAK_MEMORY_NOTE, machine, run_training, table, write_json  # noqa: I001 (sets sys.path)

P = "--parallelism."


def strategies(nproc: int) -> list[tuple[str, list[str], bool]]:
    """(name, overrides, needs a GPU)."""
    return [
        ("DDP", [P + "data_parallel_replicate_degree", str(nproc), P + "data_parallel_shard_degree", "1"], False),
        ("FSDP (reshard)", [P + "fsdp_reshard_after_forward", "always"], False),
        ("FSDP (no reshard)", [P + "fsdp_reshard_after_forward", "never"], False),
        ("HSDP", [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", str(nproc // 2)], False),
        ("FSDP + CPU offload", ["--training.enable_cpu_offload"], True),
    ]


def measure(nproc: int, overrides: list[str]) -> dict:
    reports = run_training(nproc, overrides)
    last = reports[0]["metrics"][-1]  # covers steps 2..K (log_freq K: steps 1 and K are logged)
    state = max(sum(r["model_state"].values()) for r in reports)
    peak = max(next(iter(r["memory"].values())) for r in reports)
    baseline = max(next(iter(r["memory_before_model"].values())) for r in reports)
    return {"step_s": last["step_time_s"], "loss": last["loss"], "state": state, "peak": peak, "baseline": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="125M", help="model flavor (default 125M)")
    parser.add_argument("--nproc", type=int, default=4, help="processes (even, >= 4 for HSDP; default 4)")
    parser.add_argument("--steps", type=int, default=6, help="training steps K per run (>= 3)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (batch 1 per rank)")
    parser.add_argument("--json", help="also write the measured figures (seconds, bytes, GiB) to this file")
    parser.add_argument("--only", default="", help="comma-separated strategies to run, by name or by the name's "
                        "first word (DDP, FSDP, HSDP); default all")
    parser.add_argument("--ac", default="none,full", help="activation checkpointing modes to run each strategy "
                        "with, comma separated (default none,full)")
    args = parser.parse_args()
    import torch

    has_gpu = torch.cuda.is_available()
    common = ["--model.flavor", args.flavor, "--training.steps", str(args.steps), "--training.local_batch_size", "1",
              "--training.seq_len", str(args.seq_len), "--metrics.log_freq", str(args.steps), "--debug.seed", "0"]
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    rows, results = [], []
    for name, overrides, needs_gpu in strategies(args.nproc):
        if wanted and not wanted & {name, name.split()[0]}:
            continue
        for ac in [mode.strip() for mode in args.ac.split(",") if mode.strip()]:
            if needs_gpu and not has_gpu:
                rows.append([name, ac, "n/a", "n/a", "n/a", "n/a", "n/a (no GPU: state is in host memory already)"])
                continue
            r = measure(args.nproc, [*common, *overrides, "--activation_checkpoint.mode", ac])
            results.append({"strategy": name, "ac": ac, **r})
            rows.append([name, ac, f"{r['step_s']:.2f}", f"{r['peak']:.2f}", f"{r['peak'] - r['baseline']:.2f}",
                         f"{r['state'] / MIB:,.0f}", f"{r['loss']:.5f}"])
            print(f"  measured {name} (AC {ac}): {r['step_s']:.2f} s/step", flush=True)
    print(f"{args.nproc} processes, flavor {args.flavor}, local batch 1 x {args.seq_len} tokens, fp32 AdamW, "
          f"{args.steps} steps; {machine()}")
    print(table(["strategy", "AC", "s/step", "peak memory/rank GiB", "above start GiB", "model state/rank MiB",
                 f"loss after {args.steps} steps"], rows, align="llrrrrr"))
    print(f"{PEAK_MEMORY_NOTE} 'Above start' subtracts it. Model state: parameters + gradients + optimizer "
          "state of one rank, exact bytes.")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
