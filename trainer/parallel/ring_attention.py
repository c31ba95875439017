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
visible set differs from that pattern runs with an explicit mask (the per-pair fallback), and a
pair nothing in which is visible is skipped too. Each pair runs an SDPA kernel that returns the
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
take their shapes from the fake implementations (the memory estimator runs them without a
process group), and selective activation checkpointing can keep the forward's outputs rather than
run the ring again in backward (trainer/parallel/activation_checkpointing.py).

Kernels: on CPU `_scaled_dot_product_flash_attention_for_cpu` and its backward (they share the
K/V heads of grouped-query attention themselves, and take the per-pair mask); on CUDA the flash
kernel for float16/bfloat16, the memory-efficient kernel otherwise (K/V heads repeated per pair),
and a float32 math pair for masked pairs.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

aten = torch.ops.aten

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
    with an explicit (B, Tq, Tk) visibility mask when document masking needs one."""

    q_rows: slice
    k_rows: slice
    causal: bool
    mask: Optional[Tensor] = None


def _visible(documents: Tensor, query_chunk: int, key_chunk: int, chunk: int) -> Tensor:
    """(B, chunk, chunk): the key is at or before the query and in the same document."""
    queries = torch.arange(query_chunk * chunk, (query_chunk + 1) * chunk, device=documents.device)
    keys = torch.arange(key_chunk * chunk, (key_chunk + 1) * chunk, device=documents.device)
    causal = queries[:, None] >= keys[None, :]
    return causal & (documents[:, queries, None] == documents[:, None, keys])


def _has_values(tensor: Tensor) -> bool:
    """False for the memory estimator's fake tensors, whose values cannot decide anything."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(tensor)


def block_calls(rank: int, source: int, degree: int, chunk: int, documents: Optional[Tensor]) -> list[PairCall]:
    """The kernel calls of `rank`'s queries against the keys and values of `source`. Two fully
    visible key chunks of one query chunk make one call over the whole block."""
    calls = []
    for i, query_chunk in enumerate(rank_chunks(rank, degree)):
        rows = slice(i * chunk, (i + 1) * chunk)
        pairs = []  # (key chunk's local index, causal, mask)
        for j, key_chunk in enumerate(rank_chunks(source, degree)):
            kind = chunk_pair_kind(query_chunk, key_chunk)
            if kind == SKIP:
                continue
            mask = None
            if documents is not None and not _has_values(documents):  # the memory estimator: every pair masked
                mask = _visible(documents, query_chunk, key_chunk, chunk)
            elif documents is not None:
                visible = _visible(documents, query_chunk, key_chunk, chunk)
                if not bool(visible.any()):
                    continue
                plain = visible.all() if kind == FULL else torch.equal(visible, torch.ones_like(visible).tril())
                mask = None if bool(plain) else visible
            pairs.append((j, kind == CAUSAL, mask))
        if len(pairs) == 2 and not any(causal or mask is not None for _, causal, mask in pairs):
            calls.append(PairCall(rows, slice(0, 2 * chunk), False))
        else:
            calls += [PairCall(rows, slice(j * chunk, (j + 1) * chunk), causal, mask) for j, causal, mask in pairs]
    return calls


# ---------------------------------------------------------------------------------------------
# One pair: heads-first views q (B, H, Tq, D), k and v (B, H_kv, Tk, D).

def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _repeat_heads(x: Tensor, heads: int) -> Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradients of repeated K/V heads back onto their H_kv heads."""
    heads = grad.shape[1]
    return grad if heads == kv_heads else grad.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, Tq, Tk) boolean -> (B, 1, Tq, Tk) additive mask: 0 where visible, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf")).unsqueeze(1)


def _flash_applies(q: Tensor) -> bool:
    """CUDA's flash kernel: float16/bfloat16, head dim a multiple of 8 up to 256."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def pair_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor],
                 math_pairs: bool = False) -> tuple[Tensor, Tensor]:
    """(output (B, H, Tq, D) in q's dtype, log-sum-exp (B, H, Tq)); a row that sees no key of
    this pair has log-sum-exp -inf (it weighs nothing in the merge)."""
    if math_pairs or (q.device.type != "cpu" and mask is not None):
        return _math_forward(q, k, v, causal, mask)
    if q.device.type == "cpu":
        bias = None if mask is None else _additive(mask, q.dtype)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        if mask is not None:  # the kernel reports 0 for a row with nothing visible
            lse = lse.masked_fill(~mask.any(-1).unsqueeze(1), float("-inf"))
        return out, lse
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    if _flash_applies(q):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., :q.shape[2]]  # padded to a multiple of 32 rows


def pair_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  mask: Optional[Tensor], math_pairs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v (k and v with their H_kv heads) of one pair, given the merged output
    and log-sum-exp of the query rows (which make the pair's probabilities the whole row's)."""
    if math_pairs or (q.device.type != "cpu" and mask is not None):
        return _math_backward(grad_out, q, k, v, out, lse, causal, mask)
    if q.device.type == "cpu":
        bias = None if mask is None else _additive(mask, q.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=bias)
    kv_heads = k.shape[1]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    # The CUDA kernels get dense per-pair slices of the row-wise tensors (lse is a slice of columns).
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
    if _flash_applies(q):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng)
    else:
        rows = -(-q.shape[2] // 32) * 32  # the kernel's log-sum-exp rows are padded to 32
        padded = torch.nn.functional.pad(lse, (0, rows - q.shape[2]))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, padded, no_rng, no_rng, 0.0, [True, True, True, False], causal)
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)


def _scores(q: Tensor, k: Tensor, causal: bool, mask: Optional[Tensor]) -> Tensor:
    acc = accumulation_dtype(q.dtype)
    scores = q.to(acc) @ _repeat_heads(k, q.shape[1]).to(acc).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return scores if mask is None else scores.masked_fill(~(mask.unsqueeze(1) if mask.dim() == 3 else mask),
                                                          float("-inf"))


def _math_forward(q, k, v, causal, mask):
    scores = _scores(q, k, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    out = probs @ _repeat_heads(v, q.shape[1]).to(scores.dtype)
    return out.to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, causal, mask):
    scale = 1 / math.sqrt(q.shape[-1])
    acc = accumulation_dtype(q.dtype)
    probs = torch.exp(_scores(q, k, causal, mask) - lse.to(acc).unsqueeze(-1))
    grad_out, values, keys = grad_out.to(acc), _repeat_heads(v, q.shape[1]).to(acc), _repeat_heads(k, q.shape[1]).to(acc)
    dv = probs.transpose(-1, -2) @ grad_out
    dprobs = grad_out @ values.transpose(-1, -2)
    dscores = probs * (dprobs - (grad_out * out.to(acc)).sum(-1, keepdim=True))
    dq = dscores @ keys * scale
    dk = dscores.transpose(-1, -2) @ q.to(acc) * scale
    return dq.to(q.dtype), _fold_heads(dk, k.shape[1]).to(k.dtype), _fold_heads(dv, k.shape[1]).to(v.dtype)


def merge(out_acc: Tensor, lse_acc: Tensor, rows: slice, out: Tensor, lse: Tensor) -> None:
    """Fold a partial result (out, lse) of query rows `rows` into the accumulators, in place."""
    current = lse_acc[..., rows]
    merged = torch.logaddexp(current, lse.to(lse_acc.dtype))
    finite = merged.masked_fill(merged == float("-inf"), 0)  # rows nothing has been visible to yet
    old_weight = torch.exp(current - finite).unsqueeze(-1)
    new_weight = torch.exp(lse.to(lse_acc.dtype) - finite).unsqueeze(-1)
    out_acc[..., rows, :] = out_acc[..., rows, :] * old_weight + out.to(out_acc.dtype) * new_weight
    lse_acc[..., rows] = merged


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
