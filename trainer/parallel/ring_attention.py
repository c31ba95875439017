"""Ring attention: causal attention over a context-parallel group without gathering the sequence.

Each of the `degree` ranks holds two chunks of every sequence (chunks `rank` and
`2 * degree - 1 - rank` of `2 * degree`, trainer/parallel/context_parallel.py) for its queries, keys and
values. The queries stay; the keys and values travel around the ring, rank r sending to r + 1 and
receiving from r - 1, so at step s rank r holds the keys and values of rank `r - s` (mod degree).
After `degree - 1` hops every rank has seen every key chunk, holding at most two ranks' keys and
values at a time. K and V travel together, stacked in one buffer (one message per hop), and the
next hop is posted before the current block is computed, so the transfer overlaps the compute
where the backend allows it (NCCL; gloo transfers on its own threads).

Every (query chunk, key chunk) pair is classified by true chunk index: a key chunk before the
query chunk is fully visible (no mask), the same chunk is causal (`is_causal`, both start at the
same position), a later one is skipped without compute. With document masking, a pair whose
visible set differs from that pattern runs masked, a tile of query rows at a time (ring_pairs.py:
no mask or score tensor of a whole pair), and a pair nothing in which is visible is skipped too.
Which is which is read from the document indices at the chunks' ends (they never decrease along
a sequence), without building the pair's mask. Each pair runs an SDPA kernel that returns the
log-sum-exp of its rows; the partial outputs are merged by log-sum-exp in float32 (float64 for
float64 inputs).

Backward mirrors the ring: the keys and values travel again, each rank computes the gradients of
its queries against them and its share of their key/value gradients, and those shares travel with
them, summed on the way in the gradient reduction dtype (`reduce_dtype`, the configured
`mixed_precision_reduce`), until one last hop hands each sum to the rank that owns the keys.
Each pair's backward kernel is given the merged output and log-sum-exp, which makes its
probabilities the true ones of the whole row.

Forward and backward are custom ops (`torch.ops.trainer.ring_attention` and `_backward`): the
compiler keeps each as one opaque node (its communication never enters a graph), fake tensors
take their shapes from the fake implementations (the memory estimator's tracker runs their bodies
instead, to count what they allocate), and selective activation checkpointing can keep the forward's outputs rather than
run the ring again in backward (trainer/parallel/activation_checkpointing.py).

The kernels of one pair are ring_pairs.py's.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.parallel.ring_pairs import DocumentMask, accumulation_dtype, merge, pair_backward, pair_forward

FULL, CAUSAL, SKIP = "full", "causal", "skip"


def rank_chunks(rank: int, degree: int) -> tuple[int, int]:
    """The two chunk indices (of 2 x degree) whose tokens `rank` holds: head and tail."""
    return rank, 2 * degree - 1 - rank


def ring_source(rank: int, step: int, degree: int) -> int:
    """Whose keys and values `rank` holds at ring step `step` (they come from rank - 1)."""
    return (rank - step) % degree


def chunk_pair_kind(query_chunk: int, key_chunk: int) -> str:
    """FULL (every key before every query), CAUSAL (the same chunk) or SKIP (every key after)."""
    if key_chunk < query_chunk:
        return FULL
    return CAUSAL if key_chunk == query_chunk else SKIP


def schedule(rank: int, degree: int) -> list[list[tuple[int, int, str]]]:
    """For each ring step, (query chunk, key chunk, kind) of the four pairs `rank` meets."""
    return [[(q, k, chunk_pair_kind(q, k)) for q in rank_chunks(rank, degree)
             for k in rank_chunks(ring_source(rank, step, degree), degree)] for step in range(degree)]


@dataclass(frozen=True)
class PairCall:
    """One kernel call: local query rows x rows of the key/value block held, causal or full,
    or masked by documents (the mask holds causality)."""

    q_rows: slice
    k_rows: slice
    causal: bool
    mask: Optional[DocumentMask] = None


def _has_values(tensor: Tensor) -> bool:
    """False for the memory estimator's fake tensors, whose values cannot decide anything."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(tensor)


def pair_mask(documents: Tensor, query_chunk: int, key_chunk: int, chunk: int, kind: str) -> Optional[DocumentMask]:
    """The mask of a pair cut by a document boundary; None when the pair is FULL or CAUSAL as
    without documents; SKIP when nothing in it is visible. Document indices never decrease
    along a sequence, so the chunks' end positions decide: a key chunk before the queries shares
    a document with them only through its last key and their first query, and a pair is one
    document when its first key and last query are."""
    queries, keys = query_chunk * chunk, key_chunk * chunk
    mask = DocumentMask(documents, queries, keys, chunk)
    if not _has_values(documents):  # the memory estimator: every pair masked, the most a pair holds
        return mask
    first_query, last_query = documents[:, queries], documents[:, queries + chunk - 1]
    if kind == FULL and not bool((documents[:, keys + chunk - 1] == first_query).any()):
        return SKIP
    return None if bool((documents[:, keys] == last_query).all()) else mask


def block_calls(rank: int, source: int, degree: int, chunk: int, documents: Optional[Tensor]) -> list[PairCall]:
    """The kernel calls of `rank`'s queries against the keys and values of `source`. Two fully
    visible key chunks of one query chunk make one call over the whole block."""
    calls = []
    for i, query_chunk in enumerate(rank_chunks(rank, degree)):
        rows = slice(i * chunk, (i + 1) * chunk)
        pairs = []  # (key chunk's local index, causal, mask)
        for j, key_chunk in enumerate(rank_chunks(source, degree)):
            kind = chunk_pair_kind(query_chunk, key_chunk)
            mask = pair_mask(documents, query_chunk, key_chunk, chunk, kind) if documents is not None else None
            if kind == SKIP or mask is SKIP:
                continue
            pairs.append((j, kind == CAUSAL and mask is None, mask))
        if len(pairs) == 2 and not any(causal or mask is not None for _, causal, mask in pairs):
            calls.append(PairCall(rows, slice(0, 2 * chunk), False))
        else:
            calls += [PairCall(rows, slice(j * chunk, (j + 1) * chunk), causal, mask) for j, causal, mask in pairs]
    return calls


# ---------------------------------------------------------------------------------------------
# The ring.

class Hop:
    """One step of the ring: each tensor of `sends` goes to the next rank, a buffer of the same
    shape comes from the previous one. Posted at once (`dist.batch_isend_irecv`), awaited by `wait`."""

    def __init__(self, sends: list[Tensor], group, rank: int, degree: int):
        following = dist.get_global_rank(group, (rank + 1) % degree)
        preceding = dist.get_global_rank(group, (rank - 1) % degree)
        self.received = [torch.empty_like(t) for t in sends]
        ops = []
        for tag, (send, receive) in enumerate(zip(sends, self.received)):
            ops += [dist.P2POp(dist.isend, send.contiguous(), following, group, tag),
                    dist.P2POp(dist.irecv, receive, preceding, group, tag)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor], group, rank: int,
                 degree: int) -> tuple[Tensor, Tensor]:
    """q (B, L, H, D), k and v (B, L, H_kv, D), this rank's two chunks -> (output (B, L, H, D),
    log-sum-exp (B, H, L) in the accumulation dtype)."""
    batch, local, heads, dim = q.shape
    chunk = local // 2
    acc = accumulation_dtype(q.dtype)
    out_acc = torch.zeros((batch, local, heads, dim), dtype=acc, device=q.device)  # q's layout, as the fake
    lse_acc = torch.full((batch, heads, local), float("-inf"), dtype=acc, device=q.device)
    queries = _heads_first(q)
    kv = torch.stack([k, v])  # one buffer: one message per hop
    for step in range(degree):
        hop = Hop([kv], group, rank, degree) if step < degree - 1 else None
        keys, values = _heads_first(kv[0]), _heads_first(kv[1])
        for call in block_calls(rank, ring_source(rank, step, degree), degree, chunk, documents):
            out, lse = pair_forward(queries[:, :, call.q_rows], keys[:, :, call.k_rows], values[:, :, call.k_rows],
                                    call.causal, call.mask)
            merge(_heads_first(out_acc), lse_acc, call.q_rows, out, lse)
        if hop is not None:
            [kv] = hop.wait()
    return out_acc.to(q.dtype), lse_acc


def add_partial(arrived: Tensor, own: Tensor) -> Tensor:
    """The key/value gradient sum travelling the ring, with this rank's share added."""
    return arrived + own


def ring_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor], out: Tensor,
                  lse: Tensor, group, rank: int, degree: int,
                  reduce_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of this rank's q, k and v. Keys and values travel as in forward; the gradient
    sum of the keys and values held at step s travels one hop behind them and reaches its owner
    after `degree` hops, summed in `reduce_dtype`."""
    local = q.shape[1]
    chunk = local // 2
    acc = accumulation_dtype(q.dtype)
    reduce = reduce_dtype or k.dtype
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    queries, grads, outs = _heads_first(q), _heads_first(grad_out), _heads_first(out)
    kv = torch.stack([k, v])
    travelling = None  # the gradient sum of the keys and values held at the previous step
    for step in range(degree):
        sends = ([kv] if step < degree - 1 else []) + ([travelling] if travelling is not None else [])
        hop = Hop(sends, group, rank, degree) if sends else None
        keys, values = _heads_first(kv[0]), _heads_first(kv[1])
        own = torch.zeros(kv.shape, dtype=reduce, device=kv.device)  # (2, B, L, H_kv, D)
        for call in block_calls(rank, ring_source(rank, step, degree), degree, chunk, documents):
            rows = call.q_rows
            dq, dk, dv = pair_backward(grads[:, :, rows], queries[:, :, rows], keys[:, :, call.k_rows],
                                       values[:, :, call.k_rows], outs[:, :, rows], lse[..., rows],
                                       call.causal, call.mask)
            dq_acc[:, rows] += _heads_first(dq)
            own[0][:, call.k_rows] += _heads_first(dk)
            own[1][:, call.k_rows] += _heads_first(dv)
        received = hop.wait() if hop is not None else []
        if step < degree - 1:
            kv = received[0]
        travelling = own if step == 0 else add_partial(received[-1], own)
    dkv = Hop([travelling], group, rank, degree).wait()[0] if degree > 1 else travelling
    # Copies: the two must not share dkv's storage (custom-op outputs may not alias).
    return dq_acc.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


# ---------------------------------------------------------------------------------------------
# Custom ops and their autograd.

def ring_attention_body(q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor], group_name: str, rank: int,
                        degree: int, reduce_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """What the op computes, callable as plain code (the memory estimator runs it so, to see the
    tensors it allocates: trainer/estimate/step_memory.py)."""
    return ring_forward(q, k, v, documents, _group(group_name), rank, degree)


def ring_attention_backward_body(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor],
                                 out: Tensor, lse: Tensor, group_name: str, rank: int, degree: int,
                                 reduce_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    return ring_backward(grad_out.contiguous(), q, k, v, documents, out, lse, _group(group_name), rank, degree,
                         reduce_dtype)


@torch.library.custom_op("trainer::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor], group_name: str, rank: int,
                   degree: int, reduce_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """Causal (optionally document-masked) attention of this rank's query chunks over the whole
    sequence of its CP group -> (output (B, L, H, D), log-sum-exp (B, H, L)). `reduce_dtype` is
    used by backward only (the key/value gradient sums)."""
    return ring_attention_body(q, k, v, documents, group_name, rank, degree, reduce_dtype)


@ring_attention.register_fake
def _ring_attention_fake(q, k, v, documents, group_name, rank, degree, reduce_dtype):
    batch, local, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, local), dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("trainer::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor],
                            out: Tensor, lse: Tensor, group_name: str, rank: int, degree: int,
                            reduce_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    return ring_attention_backward_body(grad_out, q, k, v, documents, out, lse, group_name, rank, degree,
                                        reduce_dtype)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(grad_out, q, k, v, documents, out, lse, group_name, rank, degree, reduce_dtype):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, documents, group_name, rank, degree, reduce_dtype = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, documents, out, lse)
    ctx.ring = (group_name, rank, degree, reduce_dtype)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, documents, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.trainer.ring_attention_backward(grad_out, q, k, v, documents, out, lse, *ctx.ring)
    return dq, dk, dv, None, None, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)


def ring_bytes(op_name: str, args) -> int:
    """Bytes one rank sends in one call of a ring op (for collective counting): the stacked keys
    and values on each of degree - 1 hops, and in backward also the key/value gradient sums on
    each of degree hops, in the reduction dtype."""
    if op_name == "ring_attention":
        k, degree = args[1], args[6]
        return 2 * k.numel() * k.element_size() * (degree - 1)
    k, degree, reduce_dtype = args[2], args[9], args[10]
    reduce_size = torch.empty((), dtype=reduce_dtype or k.dtype).element_size()
    return 2 * k.numel() * (k.element_size() * (degree - 1) + reduce_size * degree)
