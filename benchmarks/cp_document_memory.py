"""One context-parallel rank's ring attention under document masking: its peak memory against the
CP degree, with masked chunk pairs computed a tile of query rows at a time (the trainer's,
trainer/parallel/ring_pairs.py) and as whole pairs (one tile per pair: a chunk x chunk mask, and
on CUDA's math kernel the float32 scores of every head, as ring attention computed them before).

    python benchmarks/cp_document_memory.py [--seq-lens 4096 8192 16384] [--cp 2 4 8] [--fake-seq-len 131072]
                                            [--device cuda]

One process, no process group: the ring's hops hand each block on unchanged (what a rank holds has
the shapes of what it would receive). Rank 0, batch 1, 8 query heads, 2 K/V heads, head dim 64,
float32 (bfloat16 on CUDA), documents of 1,000 tokens (a boundary in most chunk pairs). Kernels:
`device` (on a CPU the flash kernel with each tile's mask as a bias; on CUDA flash for unmasked
pairs and the float32 math kernel for masked tiles) and `math` (the math kernel for every pair).
Peak beyond the inputs over forward and backward: torch's MemTracker on a CPU, the allocator's
max_memory_allocated on CUDA. At --fake-seq-len the same runs on fake tensors on the CPU (shapes
only; every pair taken as masked), where real ones would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from unittest import mock

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from common import MIB, machine, table  # noqa: I001 (sets sys.path)
from trainer.parallel import ring_attention, ring_pairs

HEADS, KV_HEADS, HEAD_DIM, DOCUMENT = 8, 2, 64, 1000


class HandOn:
    """Stands in for ring_attention.Hop: each block 'arrives' unchanged, with no communication."""

    def __init__(self, sends, group, rank, degree):
        self.received = sends

    def wait(self):
        return self.received


def rank_peak(seq_len: int, degree: int, kernel: str, whole_pairs: bool, fake: bool = False,
              device: torch.device = torch.device("cpu")) -> int:
    """Peak bytes beyond the inputs of rank 0's ring forward and backward."""
    local = seq_len // degree
    tile_rows = local // 2 if whole_pairs else None
    math_pairs = kernel == "math"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with contextlib.ExitStack() as stack:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode())
        q = torch.randn(1, local, HEADS, HEAD_DIM, device=device, dtype=dtype)
        k, v = (torch.randn(1, local, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
        documents = (torch.arange(seq_len, device=device) // DOCUMENT).unsqueeze(0)
        stack.enter_context(mock.patch.object(ring_attention, "Hop", HandOn))
        for name in ("pair_forward", "pair_backward"):
            kernel_fn = functools.partial(getattr(ring_pairs, name), math_pairs=math_pairs, tile_rows=tile_rows)
            stack.enter_context(mock.patch.object(ring_attention, name, kernel_fn))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            out, lse = ring_attention.ring_forward(q, k, v, documents, None, 0, degree)
            ring_attention.ring_backward(torch.ones_like(out), q, k, v, documents, out, lse, None, 0, degree, None)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        tracker = MemTracker()
        with tracker:
            out, lse = ring_attention.ring_forward(q, k, v, documents, None, 0, degree)
            ring_attention.ring_backward(torch.ones_like(out), q, k, v, documents, out, lse, None, 0, degree, None)
        return sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--kernels", nargs="+", default=None, choices=["device", "math"],
                        help="device: the device's own (CPU flash; on CUDA flash, math for masked tiles); math: "
                             "the math kernel throughout (default: both on a CPU, device on CUDA)")
    parser.add_argument("--fake-seq-len", type=int, default=131072, help="0: none")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = parser.parse_args()
    device = torch.device(a.device)
    kernels = a.kernels or (["device", "math"] if device.type == "cpu" else ["device"])
    print(f"# {machine()}; masked pairs in tiles of {ring_pairs.TILE_ROWS} query rows; "
          f"{'bfloat16 on CUDA, peak: max_memory_allocated' if device.type == 'cuda' else 'float32, peak: MemTracker'}")
    rows = []
    runs = [(seq, False) for seq in a.seq_lens] + ([(a.fake_seq_len, True)] if a.fake_seq_len else [])
    for seq_len, fake in runs:
        for kernel in kernels:
            for degree in a.cp:
                on = torch.device("cpu") if fake else device
                tiled = rank_peak(seq_len, degree, kernel, whole_pairs=False, fake=fake, device=on)
                whole = rank_peak(seq_len, degree, kernel, whole_pairs=True, fake=fake, device=on)
                name = f"{on.type} {'flash' if on.type == 'cpu' else 'kernels'}" if kernel == "device" else kernel
                rows.append([f"{seq_len:,}{' (fake)' if fake else ''}", name, degree, f"{tiled / MIB:,.1f}",
                             f"{tiled * degree / MIB:,.0f}", f"{whole / MIB:,.1f}", f"{whole * degree / MIB:,.0f}"])
    print(table(["tokens", "kernel", "cp", "tiled peak MiB", "x cp", "whole pairs peak MiB", "x cp"], rows))


if __name__ == "__main__":
    main()
