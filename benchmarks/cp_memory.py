"""Context-parallel attention, before (all-gathered keys and values, a (T/cp) x T mask) and after
(the ring of trainer/parallel/ring_attention.py): memory per attention layer and step time.

    python benchmarks/cp_memory.py [--cp 2 4] [--seq-lens 1024 4096 8192] [--steps 5]

For each CP degree, `cp` processes (gloo on CPU; NCCL with one GPU each when there are enough)
run one attention layer (batch 1, 8 query heads, 2 K/V heads, head dim 64; float32 on CPU,
bfloat16 on CUDA) forward and backward at each sequence length, with each implementation:

* saved bytes: what autograd keeps for backward (every storage seen by saved_tensors_hooks, once);
* peak: the most bytes alive at once during forward + backward, beyond the inputs: on CUDA
  `torch.cuda.max_memory_allocated`, on CPU torch's MemTracker (a dispatch mode that sees every
  tensor created). On CPU the ring runs as a plain autograd function over the same forward and
  backward functions as the trainer's custom ops, so MemTracker sees inside it too (it sees a
  custom op as one call); on CUDA the trainer's op itself runs.

Then the step time of a small model (debugmodel flavor, FSDP x CP over the same processes, batch 1,
--step-seq-len tokens, float32 on CPU): forward + backward with each implementation, alternated
step by step (a shared machine's load moves both alike), median of --steps after one warm-up.
The previous implementation lives only here and in tests/unit/test_ring_attention.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import machine, table  # noqa: I001 (sets sys.path)
from trainer.models.llama3.model import document_causal_mask, grouped_query_attention
from trainer.parallel import ring_attention
from trainer.parallel.context_parallel import ContextParallelAttention, load_balanced_positions
from trainer.launch.process_exit import exit_without_teardown

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
MIB = float(1 << 20)


class GatherSequence(torch.autograd.Function):
    """The previous CP's all-gather along the sequence (functional), reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        world = dist.get_world_size(group)
        functional = torch.ops._c10d_functional
        gathered = functional.wait_tensor(functional.all_gather_into_tensor(x.contiguous(), world, group.group_name))
        return gathered.unflatten(0, (world, -1)).movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        per_rank = grad.unflatten(1, (world, -1)).movedim(1, 0).flatten(0, 1)
        per_rank = per_rank.to(ctx.reduce_dtype or grad.dtype).contiguous()
        local = per_rank.new_empty((per_rank.shape[0] // world, *per_rank.shape[1:]))
        dist.reduce_scatter_single(local, per_rank, op=dist.ReduceOp.SUM, group=ctx.group)
        return local.to(grad.dtype), None, None


class AllGatherAttention(ContextParallelAttention):
    """The previous attention core: gathered keys and values, masked by true positions."""

    def __call__(self, q, k, v, documents=None):
        local = q.shape[1]
        k = GatherSequence.apply(k, self.group, self.reduce_dtype)
        v = GatherSequence.apply(v, self.group, self.reduce_dtype)
        queries = self.positions(local, q.device)
        keys = torch.cat([load_balanced_positions(r, self.degree, local * self.degree, q.device)
                          for r in range(self.degree)])
        if documents is not None:
            return grouped_query_attention(q, k, v, attn_mask=document_causal_mask(documents, queries, keys))
        return grouped_query_attention(q, k, v, attn_mask=queries[:, None] >= keys[None, :])


class _VisibleRing(torch.autograd.Function):
    """The trainer's ring forward and backward, as an autograd function (not custom ops), so
    that a dispatch mode sees every tensor they create."""

    @staticmethod
    def forward(ctx, q, k, v, core):
        out, lse = ring_attention.ring_forward(q, k, v, None, core.group, core.rank, core.degree)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core = core
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        core = ctx.core
        dq, dk, dv = ring_attention.ring_backward(grad.contiguous(), q, k, v, None, out, lse, core.group, core.rank,
                                                  core.degree, core.reduce_dtype)
        return dq, dk, dv, None


class VisibleRingAttention(ContextParallelAttention):
    def __call__(self, q, k, v, documents=None):
        return _VisibleRing.apply(q, k, v, self)


class Mesh:
    """What the attention cores ask of a device mesh."""

    def __init__(self, group):
        self.group = group

    def get_group(self):
        return self.group

    def get_local_rank(self):
        return dist.get_rank(self.group)

    def size(self):
        return dist.get_world_size(self.group)


def layer_memory(core, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int, float]:
    """(saved bytes, peak bytes beyond the inputs, seconds) of one attention layer's forward + backward."""
    degree = dist.get_world_size()
    local = seq_len // degree
    generator = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, local, heads, HEAD_DIM, generator=generator).to(device, dtype).requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    upstream = torch.randn(1, local, HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dist.barrier()
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = core(q, k, v)
        out.backward(upstream)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = core(q, k, v)
            out.backward(upstream)
        peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    seconds = time.perf_counter() - start
    return sum(storages.values()), peak, seconds


def step_times(seq_len: int, steps: int, device: torch.device) -> dict[str, float]:
    """Median forward + backward seconds of the debug model under FSDP x CP, per implementation."""
    from trainer.config.manager import load_config, with_default_config
    from trainer.models.llama3 import Transformer, get_flavor
    from trainer.parallel import parallelize
    from trainer.parallel.context_parallel import shard_sequence
    from trainer.parallel.dims import ParallelDims

    degree = dist.get_world_size()
    config = load_config(with_default_config(["--model.flavor", "debugmodel", "--training.seq_len", str(seq_len),
                                              "--parallelism.context_parallel_degree", str(degree)]))
    dims = ParallelDims.from_config(config.parallelism, degree)
    mesh = dims.build_mesh(device.type)
    args = get_flavor("debugmodel")
    args.max_seq_len = seq_len
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims, mesh, config, device)
    model.to_empty(device=device)
    model.init_weights(seed=0, device=device)
    cores = {"all-gather": AllGatherAttention(mesh["cp"]), "ring": ContextParallelAttention(mesh["cp"])}
    tokens = torch.randint(0, args.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    tokens = shard_sequence(tokens, mesh["cp"].get_local_rank(), degree).to(device)
    times: dict[str, list[float]] = {name: [] for name in cores}
    for step in range(steps + 1):
        for name, core in cores.items():
            model.apply_runtime(model.runtime.with_blocks(attention_core=core))
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(tokens).float().logsumexp(-1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends with its slowest rank
            if step:  # the first is a warm-up
                times[name].append(elapsed.item())
            model.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def worker(rank: int, degree: int, init_file: str, options, results) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=degree)
    dtype = torch.bfloat16 if cuda else torch.float32
    mesh = Mesh(dist.group.WORLD)
    ring = ContextParallelAttention(mesh) if cuda else VisibleRingAttention(mesh)
    cores = {"all-gather": AllGatherAttention(mesh), "ring": ring}
    for seq_len in options.seq_lens:
        for name, core in cores.items():
            saved, peak, seconds = layer_memory(core, seq_len, device, dtype)
            figures = torch.tensor([saved, peak, seconds], dtype=torch.float64)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the largest rank
            if rank == 0:
                results[("layer", degree, seq_len, name)] = figures.tolist()
    if options.steps and options.step_seq_len % (2 * degree) == 0:
        medians = step_times(options.step_seq_len, options.steps, device)
        if rank == 0:
            results[("step", degree)] = medians
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran collectives: see trainer.launch.process_exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP degrees (default: 2 4)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 8192],
                        help="sequence lengths of the attention-layer table (default: 1024 4096 8192)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation (0: no step times)")
    parser.add_argument("--step-seq-len", type=int, default=2048, help="sequence length of the timed steps")
    options = parser.parse_args(argv)
    for degree in options.cp:
        if any(seq % (2 * degree) for seq in options.seq_lens):
            parser.error(f"--seq-lens must be multiples of 2 x cp = {2 * degree}")
    print(f"# {machine()}")
    with mp.Manager() as manager:
        results = manager.dict()
        for degree in options.cp:
            if torch.cuda.is_available() and torch.cuda.device_count() < degree:
                print(f"CP {degree}: skipped, {torch.cuda.device_count()} GPU(s) here")
                continue
            print(f"CP {degree}: {degree} processes ...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as folder:
                mp.spawn(worker, args=(degree, os.path.join(folder, "init"), options, results), nprocs=degree,
                         join=True)
        results = dict(results)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rows = []
    for (kind, degree, *rest), figures in sorted((k, v) for k, v in results.items() if k[0] == "layer"):
        seq_len, name = rest
        if name != "all-gather":
            continue
        before, after = figures, results[("layer", degree, seq_len, "ring")]
        rows.append([degree, seq_len, f"{before[0] / MIB:.2f}", f"{after[0] / MIB:.2f}", f"{before[1] / MIB:.2f}",
                     f"{after[1] / MIB:.2f}", f"{before[1] / after[1]:.1f}x"])
    print(f"\nOne attention layer, forward + backward, batch 1, {HEADS} heads ({KV_HEADS} K/V), head dim {HEAD_DIM}, "
          f"{dtype}; MiB on the largest rank:\n")
    print(table(["cp", "seq len", "saved before", "saved after", "peak before", "peak after", "peak ratio"], rows))
    steps = [(degree, results[("step", degree)]) for degree in options.cp if ("step", degree) in results]
    if steps:
        print(f"\nStep (forward + backward) of the debugmodel flavor, FSDP x CP, batch 1 x {options.step_seq_len} "
              f"tokens, median of {options.steps}:\n")
        print(table(["cp", "all-gather s", "ring s", "ring / all-gather"],
                    [[degree, f"{m['all-gather']:.3f}", f"{m['ring']:.3f}", f"{m['ring'] / m['all-gather']:.2f}"]
                     for degree, m in steps]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
