"""The ring attention's kernel work on one device, against whole-sequence attention.

    python benchmarks/ring_kernels.py [--cp 2 4 8] [--seq-lens 8192 32768] [--heads 32] [--kv-heads 8]
                                      [--head-dim 64] [--repeats 5]

Context parallelism splits a sequence's attention over cp ranks (trainer/parallel/ring_attention.py):
each rank runs, for its two query chunks, one kernel call per visible (query chunk, key chunk)
pair and merges the partial results by log-sum-exp; backward mirrors it. This script runs the
calls of one rank on one device, with the ring's sends replaced by handing each block on
unchanged (the kernels' time does not depend on the values), and sets its forward + backward time
and peak memory beside whole-sequence causal attention (SDPA: flash on a GPU in bfloat16) of the
same sequence. With perfect splitting a rank would take 1/cp of the whole-sequence time: the
'efficiency' column is that ideal over the rank's measured time (communication left out, which
the ring overlaps with these kernels). bfloat16 on CUDA, float32 on a CPU; batch 1; the median of
--repeats after one warm-up; rank 0 and the last rank (head-tail balancing gives both the same
work).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from common import machine, synchronize, table  # noqa: I001 (sets sys.path)
from trainer.parallel import ring_attention


class HandOn:
    """Stands in for ring_attention.Hop: each block 'arrives' unchanged, with no communication."""

    def __init__(self, sends, group, rank, degree):
        self.received = sends

    def wait(self):
        return self.received


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(median seconds, peak bytes above the start) of fn()."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        began = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) - start_bytes if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def whole_sequence(q, k, v):
    """Causal attention of the whole sequence, forward and backward (q, k, v: (B, H, T, D))."""
    def run():  # K/V heads repeated as the ring's CUDA pairs do (every SDPA kernel then applies)
        heads = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(heads, 1), v.repeat_interleave(heads, 1),
                                             is_causal=True)
        out.backward(torch.ones_like(out))
    return run


def one_rank(q, k, v, rank: int, degree: int):
    """The ring's forward and backward kernel calls of `rank` (q, k, v: (B, L, H, D), its chunks)."""
    def run():
        with mock.patch.object(ring_attention, "Hop", HandOn):
            out, lse = ring_attention.ring_forward(q, k, v, None, None, rank, degree)
            ring_attention.ring_backward(torch.ones_like(out), q, k, v, None, out, lse, None, rank, degree, None)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for seq_len in args.seq_lens:
        shape = dict(device=device, dtype=dtype)
        q = torch.randn(1, args.heads, seq_len, args.head_dim, **shape, requires_grad=True)
        k = torch.randn(1, args.kv_heads, seq_len, args.head_dim, **shape, requires_grad=True)
        v = torch.randn(1, args.kv_heads, seq_len, args.head_dim, **shape, requires_grad=True)
        whole_s, whole_peak = timed(whole_sequence(q, k, v), device, args.repeats)
        for degree in args.cp:
            if seq_len % (2 * degree):
                continue
            chunk = seq_len // (2 * degree)
            for rank in sorted({0, degree - 1}):
                heads_last = [torch.randn(1, 2 * chunk, h, args.head_dim, **shape)
                              for h in (args.heads, args.kv_heads, args.kv_heads)]
                rank_s, rank_peak = timed(one_rank(*heads_last, rank, degree), device, args.repeats)
                rows.append([str(seq_len), str(degree), str(rank), f"{1000 * whole_s:.2f}",
                             f"{1000 * whole_s / degree:.2f}", f"{1000 * rank_s:.2f}",
                             f"{whole_s / degree / rank_s:.2f}", mib(whole_peak), mib(rank_peak)])
        del q, k, v
    where = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if device.type == "cuda" else machine()
    print(f"attention forward + backward, batch 1, {args.heads} heads ({args.kv_heads} K/V), head dim "
          f"{args.head_dim}, {str(dtype)[6:]}, median of {args.repeats}; {where}")
    print(table(["seq len", "cp", "rank", "whole ms", "whole / cp ms", "ring rank ms", "efficiency",
                 "whole peak MiB", "ring rank peak MiB"], rows, align="lllrrrrrr"))


def mib(value: float) -> str:
    return "n/a" if value != value else f"{value / 2**20:,.0f}"


if __name__ == "__main__":
    main()
