"""Context-parallel attention over 2 gloo processes equals causal attention of the whole sequence,
in the forward and in the gradients of queries, keys and values (GQA: 4 query heads, 2 K/V heads).
Backward keeps this rank's keys and values with their 2 heads and nothing of the whole sequence
(the ring attention of trainer/parallel/ring_attention.py; CP 4 and float32 in
tests/unit/test_ring_attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ranks import start_ranks
from trainer.models.llama3.model import CausalAttention
from trainer.parallel.context_parallel import ContextParallelAttention, shard_sequence
from trainer.launch.process_exit import exit_without_teardown

CP = 2
B, T, HEADS, KV_HEADS, DIM = 2, 16, 4, 2, 8


def reference_inputs():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, HEADS, DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(B, T, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(B, T, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(B, T, HEADS, DIM, generator=generator, dtype=torch.float64)
    return q, k, v, upstream


def reference_documents() -> torch.Tensor:
    """Document indices: row 0 holds documents of 5, 6 and 5 tokens, row 1 one document."""
    return torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * T])


def run_rank(rank: int, init_file: str, results, with_documents: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=CP)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))
    q, k, v, upstream = reference_inputs()
    local = [shard_sequence(t, rank, CP).detach().requires_grad_() for t in (q, k, v)]
    core = ContextParallelAttention(mesh)
    saved_shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_shapes.append(tuple(t.shape)) or t, lambda t: t):
        out = core(*local, reference_documents() if with_documents else None)
    (out * shard_sequence(upstream, rank, CP)).sum().backward()
    results[rank] = (out.detach(), *(t.grad for t in local), core.positions(T // CP, out.device), saved_shapes)
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.mark.parametrize("with_documents", [False, True], ids=["causal", "document-masked"])
def test_cp_attention_matches_full_sequence_attention(tmp_path, with_documents):
    with mp.Manager() as manager:
        results = manager.dict()
        start_ranks(run_rank, (str(tmp_path / "init"), results, with_documents), CP)
        results = dict(results)

    q, k, v, upstream = (t.requires_grad_() if i < 3 else t for i, t in enumerate(reference_inputs()))
    out = CausalAttention()(q, k, v, reference_documents() if with_documents else None)
    (out * upstream).sum().backward()

    for rank in range(CP):
        cp_out, dq, dk, dv, positions, saved_shapes = results[rank]
        # Backward keeps the local K and V with their 2 heads, not 4 copies, and nothing of length T.
        assert (B, T // CP, KV_HEADS, DIM) in saved_shapes and (B, T // CP, HEADS, DIM) in saved_shapes
        assert not any(T in shape for shape in saved_shapes if shape != (B, T)), saved_shapes  # (B, T): documents
        torch.testing.assert_close(positions, torch.cat([torch.arange(rank * 4, rank * 4 + 4),
                                                         torch.arange((3 - rank) * 4, (4 - rank) * 4)]))
        torch.testing.assert_close(cp_out, shard_sequence(out.detach(), rank, CP), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dq, shard_sequence(q.grad, rank, CP), rtol=1e-12, atol=1e-12)
        # Keys and values serve every rank's queries: their gradients were summed back by reduce-scatter.
        torch.testing.assert_close(dk, shard_sequence(k.grad, rank, CP), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dv, shard_sequence(v.grad, rank, CP), rtol=1e-12, atol=1e-12)
