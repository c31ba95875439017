"""Ring attention (trainer/parallel/ring_attention.py) against two references, in float32 on gloo.

One spawn of 4 processes runs CP 4 over all of them and CP 2 over ranks {0, 1} and {2, 3}, with
grouped-query attention (4 query heads, 2 K/V heads), causal and document-masked. Forward and the
gradients of q, k and v equal, within 1e-6 (absolute, plus 1e-6 relative; see TOL), (1) causal attention of the whole sequence on one
process and (2) the previous implementation, which all-gathered the keys and values and masked
by true positions (kept here as a reference only). Deliberate faults (a dropped diagonal, the ring
turning the wrong way, key/value gradient sums dropped on the way) must miss by far more than
that, and the key/value gradient sums travel in the reduction dtype (float32 under bfloat16).
Single-process checks: the schedule covers every causal (query chunk, key chunk) pair once, and
the math pair (CUDA's masked fallback) equals the CPU flash kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ranks import start_ranks
from trainer.models.llama3.model import CausalAttention, document_causal_mask, grouped_query_attention
from trainer.parallel import ring_attention
from trainer.parallel.context_parallel import ContextParallelAttention, load_balanced_positions, shard_sequence
from trainer.launch.process_exit import exit_without_teardown

# Its fixture spawns the ring's ranks, which keep both cores busy (tests/machine_share.py).
pytestmark = pytest.mark.cores(2)

WORLD = 4
B, T, HEADS, KV_HEADS, DIM = 2, 32, 4, 2, 8
# |difference| <= 1e-6 + 1e-6 |expected|. Gradient entries reach 4.4 here, where float32's spacing is
# 4.8e-7: a different order of the same sums moves them by 2 ulp (1.9e-6). The previous all-gather CP
# itself is 1.9e-6 from whole-sequence attention at CP 4; ring and all-gather CP are within 9.6e-7.
TOL = 1e-6


def inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(5)
    shapes = [(B, T, HEADS, DIM), (B, T, KV_HEADS, DIM), (B, T, KV_HEADS, DIM), (B, T, HEADS, DIM)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def documents() -> torch.Tensor:
    """Row 0: documents of 5, 9, 3 and 15 tokens (boundaries inside chunks and on none of them);
    row 1: one document."""
    return torch.tensor([[0] * 5 + [1] * 9 + [2] * 3 + [3] * 15, [0] * T])


class GatherSequence(torch.autograd.Function):
    """The previous CP: all-gather along the sequence; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        local = torch.empty_like(grad.chunk(world, dim=1)[0])
        dist.reduce_scatter(local, [g.contiguous() for g in grad.chunk(world, dim=1)], group=ctx.group)
        return local, None


def all_gather_attention(q, k, v, docs, group, rank, degree):
    k, v = GatherSequence.apply(k, group), GatherSequence.apply(v, group)
    queries = load_balanced_positions(rank, degree, T)
    keys = torch.cat([load_balanced_positions(r, degree, T) for r in range(degree)])
    mask = (queries[:, None] >= keys[None, :]) if docs is None else document_causal_mask(docs, queries, keys)
    return grouped_query_attention(q, k, v, attn_mask=mask)


class CpMesh:
    """The two things ContextParallelAttention asks of a device mesh."""

    def __init__(self, group, rank, degree):
        self.group, self.rank, self.degree = group, rank, degree

    def get_group(self):
        return self.group

    def get_local_rank(self):
        return self.rank

    def size(self):
        return self.degree


def local_run(attend, rank, degree, docs, dtype=torch.float32):
    q, k, v, upstream = inputs(dtype)
    local = [shard_sequence(t, rank, degree).detach().requires_grad_() for t in (q, k, v)]
    out = attend(*local, docs)
    (out.float() * shard_sequence(upstream, rank, degree).float()).sum().backward()
    return [out.detach()] + [t.grad for t in local]


def run_rank(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups = {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}
    for degree, (group, cp_rank) in groups.items():
        ring = ContextParallelAttention(CpMesh(group, cp_rank, degree))
        for docs in (None, documents()):
            name = f"cp{degree} {'documents' if docs is not None else 'causal'}"
            results[(name, rank, "ring")] = local_run(ring, cp_rank, degree, docs)
            results[(name, rank, "gather")] = local_run(
                lambda q, k, v, d: all_gather_attention(q, k, v, d, group, cp_rank, degree), cp_rank, degree, docs)
        for fault in FAULTS:
            with FAULTS[fault]():
                results[(f"cp{degree} {fault}", rank, "ring")] = local_run(ring, cp_rank, degree, documents())
        # bfloat16 activations, float32 gradient sums: record what each hop of backward carries.
        sent = []
        original = ring_attention.Hop.__init__

        def recording(self, sends, *args):
            sent.append(tuple(str(t.dtype) for t in sends))
            original(self, sends, *args)

        ring_attention.Hop.__init__ = recording
        bf16 = ContextParallelAttention(CpMesh(group, cp_rank, degree), reduce_dtype=torch.float32)
        grads = local_run(bf16, cp_rank, degree, None, dtype=torch.bfloat16)
        ring_attention.Hop.__init__ = original
        results[(f"cp{degree} bf16", rank, "messages")] = (sent, [g.dtype for g in grads])
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


class Patched:
    def __init__(self, owner, name, value):
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self):
        self.original = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)


def _hop_the_wrong_way(self, sends, group, rank, degree):
    self.received = [torch.empty_like(t) for t in sends]
    ops = []
    for tag, (send, receive) in enumerate(zip(sends, self.received)):
        ops += [dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, (rank - 1) % degree), group, tag),
                dist.P2POp(dist.irecv, receive, dist.get_global_rank(group, (rank + 1) % degree), group, tag)]
    self.works = dist.batch_isend_irecv(ops)


FAULTS = {
    "dropped diagonal": lambda: Patched(ring_attention, "chunk_pair_kind",
                                        lambda q, k: ring_attention.FULL if k < q else ring_attention.SKIP),
    "wrong hop direction": lambda: Patched(ring_attention.Hop, "__init__", _hop_the_wrong_way),
    "kv gradient sums dropped": lambda: Patched(ring_attention, "add_partial", lambda arrived, own: own),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with mp.Manager() as manager:
        results = manager.dict()
        start_ranks(run_rank, (str(tmp_path_factory.mktemp("ring") / "init"), results), WORLD)
        return dict(results)


def whole_sequence(docs):
    q, k, v, upstream = (t.requires_grad_() if i < 3 else t for i, t in enumerate(inputs()))
    out = CausalAttention()(q, k, v, docs)
    (out * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def cp_ranks(degree):
    """(global rank, rank within its CP group) of every process."""
    return [(rank, rank % degree) for rank in range(WORLD)]


def error_in_tolerances(results, name, degree, reference_of) -> float:
    """max |got - want| / (TOL + TOL |want|) over every rank's output and gradients: <= 1 passes."""
    errors = []
    for rank, cp_rank in cp_ranks(degree):
        for got, want in zip(results[(name, rank, "ring")], reference_of(rank, cp_rank)):
            errors.append(((got - want).abs() / (TOL + TOL * want.abs())).max().nan_to_num(float("inf")).item())
    return max(errors)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_ring_equals_whole_sequence_and_all_gather_attention(ranks, degree, masking):
    docs = documents() if masking == "documents" else None
    full = whole_sequence(docs)
    name = f"cp{degree} {masking}"
    for rank, cp_rank in cp_ranks(degree):
        ring, gather = ranks[(name, rank, "ring")], ranks[(name, rank, "gather")]
        for what, got, expected, previous in zip(("output", "dq", "dk", "dv"), ring, full, gather):
            torch.testing.assert_close(got, shard_sequence(expected, cp_rank, degree), rtol=TOL, atol=TOL,
                                       msg=lambda m: f"{name} rank {rank} {what} vs whole sequence: {m}")
            torch.testing.assert_close(got, previous, rtol=TOL, atol=TOL,
                                       msg=lambda m: f"{name} rank {rank} {what} vs all-gather CP: {m}")


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_ring_misses_by_far_more_than_the_tolerance(ranks, degree, fault):
    full = whole_sequence(documents())
    error = error_in_tolerances(ranks, f"cp{degree} {fault}", degree,
                      lambda rank, cp_rank: [shard_sequence(t, cp_rank, degree) for t in full])
    if fault == "wrong hop direction" and degree == 2:
        assert error <= 1  # with two ranks the previous rank is the next one: the same ring
    else:
        assert error > 1e3, f"{fault} at CP {degree} went unnoticed ({error:.2e} tolerances off)"


@pytest.mark.parametrize("degree", [2, 4])
def test_key_value_gradient_sums_travel_in_the_reduction_dtype(ranks, degree):
    for rank, _ in cp_ranks(degree):
        sent, grad_dtypes = ranks[(f"cp{degree} bf16", rank, "messages")]
        forward, backward = sent[:degree - 1], sent[degree - 1:]
        assert forward == [("torch.bfloat16",)] * (degree - 1)  # K and V stacked: one message a hop
        # Backward: K/V with the sum of the previous step, then the sums alone, then the last hop home.
        assert backward == ([("torch.bfloat16",)] + [("torch.bfloat16", "torch.float32")] * (degree - 2)
                            + [("torch.float32",), ("torch.float32",)])
        assert grad_dtypes == [torch.bfloat16] * 4  # the output and the gradients of q, k, v


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_the_schedule_meets_every_causal_pair_once_and_skips_the_rest(degree):
    met = {}
    for rank in range(degree):
        for step, pairs in enumerate(ring_attention.schedule(rank, degree)):
            for query_chunk, key_chunk, kind in pairs:
                assert (query_chunk, key_chunk) not in met
                met[(query_chunk, key_chunk)] = kind
    chunks = range(2 * degree)
    assert met == {(q, k): ("full" if k < q else "causal" if k == q else "skip") for q in chunks for k in chunks}
    # Head-tail balance: every rank computes the same number of full and causal pairs.
    work = {tuple(sorted(kind for pairs in ring_attention.schedule(r, degree) for *_, kind in pairs))
            for r in range(degree)}
    assert len(work) == 1


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_math_pair_equals_the_cpu_flash_kernel(causal, masked):
    generator = torch.Generator().manual_seed(1)
    q, grad = (torch.randn(2, 4, 8, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 8, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:  # row 3 sees nothing in this pair
        mask = torch.rand(2, 8, 8, generator=generator) > 0.4
        mask[:, :, 0] = True
        mask[:, 3] = False
        if causal:
            mask &= torch.ones(8, 8, dtype=torch.bool).tril()
    flash = ring_attention.pair_forward(q, k, v, causal and not masked, mask)
    math = ring_attention.pair_forward(q, k, v, causal and not masked, mask, math_pairs=True)
    for a, b in zip(flash, math):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    out, lse = flash
    if masked:
        assert torch.isneginf(lse[:, :, 3]).all() and (out[:, :, 3] == 0).all()
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # backward is given whole rows' log-sum-exp
    flash_grads = ring_attention.pair_backward(grad, q, k, v, out, lse, causal and not masked, mask)
    math_grads = ring_attention.pair_backward(grad, q, k, v, out, lse, causal and not masked, mask, math_pairs=True)
    for a, b in zip(flash_grads, math_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("math_pairs", [False, True])
def test_a_masked_pair_in_tiles_of_query_rows_equals_the_whole_pair(math_pairs):
    """Masked pairs run a tile of query rows at a time (trainer/parallel/ring_pairs.py), each tile
    building its own rows of the mask: the rows come out as one call over the whole pair gives
    them, and the key/value gradients sum over the tiles."""
    from trainer.parallel.ring_pairs import DocumentMask

    generator = torch.Generator().manual_seed(2)
    q, grad = (torch.randn(2, 4, 16, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    # A diagonal pair (queries and keys at positions 16-31) crossed by two document boundaries.
    mask = DocumentMask(documents()[:, :32].contiguous(), 16, 16, 16)
    whole = ring_attention.pair_forward(q, k, v, False, mask, math_pairs, tile_rows=16)
    tiled = ring_attention.pair_forward(q, k, v, False, mask, math_pairs, tile_rows=3)
    for a, b in zip(whole, tiled):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    out, lse = whole
    grads = [ring_attention.pair_backward(grad, q, k, v, out, lse, False, mask, math_pairs, tile_rows=rows)
             for rows in (16, 3)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_pairs_are_skipped_or_masked_from_the_chunk_ends_as_their_whole_masks_say(degree):
    """pair_mask decides from four document indices per row (they never decrease along a
    sequence); the decisions are those of the pair's whole visibility: skipped when nothing is
    visible, unmasked when it is the pair's plain pattern, masked otherwise."""
    from trainer.parallel.ring_pairs import DocumentMask

    generator = torch.Generator().manual_seed(3)
    for trial in range(20):
        tokens, chunk = 8 * degree, 4
        ends = torch.rand(2, tokens, generator=generator) < (0.05 + 0.1 * (trial % 4))
        documents = torch.cumsum(ends.long(), dim=1)
        for rank in range(degree):
            for source in range(degree):
                for query_chunk in ring_attention.rank_chunks(rank, degree):
                    for key_chunk in ring_attention.rank_chunks(source, degree):
                        kind = ring_attention.chunk_pair_kind(query_chunk, key_chunk)
                        if kind == ring_attention.SKIP:
                            continue
                        visible = DocumentMask(documents, query_chunk * chunk, key_chunk * chunk, chunk).rows(0, chunk)
                        plain = torch.ones(chunk, chunk, dtype=torch.bool)
                        plain = plain.tril() if kind == ring_attention.CAUSAL else plain
                        expected = (ring_attention.SKIP if not visible.any() else
                                    None if torch.equal(visible, plain.expand_as(visible)) else "masked")
                        decided = ring_attention.pair_mask(documents, query_chunk, key_chunk, chunk, kind)
                        assert (decided if decided in (None, ring_attention.SKIP) else "masked") == expected
