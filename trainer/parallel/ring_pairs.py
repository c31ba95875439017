"""One chunk pair of ring attention (trainer/parallel/ring_attention.py): its forward and backward
kernels on heads-first views q (B, H, Tq, D), k and v (B, H_kv, Tk, D), and the merge of partial
results by log-sum-exp.

A pair that document masking cuts (`DocumentMask`) runs a tile of query rows at a time: each tile
builds its own (B, rows, Tk) visibility from the document indices and calls the kernel on its rows,
so no (Tq, Tk) tensor of the pair exists, neither the mask nor, on CUDA's math kernel, the float32
scores of every head. A rank's memory for masked pairs is then O(TILE_ROWS x T / cp) and falls
as 1 / cp, as it does without documents.

Kernels: on CPU `_scaled_dot_product_flash_attention_for_cpu` and its backward (they share the
K/V heads of grouped-query attention themselves, and take the tile's mask as an additive bias);
on CUDA the flash kernel for float16/bfloat16, the memory-efficient kernel otherwise (K/V heads
repeated per pair), and a float32 math kernel for masked tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

aten = torch.ops.aten

TILE_ROWS = 256  # query rows of a masked pair per kernel call


@dataclass(frozen=True)
class DocumentMask:
    """Which keys of a chunk pair each query sees: those at or before it in its own document.
    `documents` (B, T) holds every position's document index over the whole sequence;
    `queries` and `keys` are the pair's first global positions, `length` its rows and columns."""

    documents: Tensor
    queries: int
    keys: int
    length: int

    def rows(self, start: int, stop: int) -> Tensor:
        """(B, stop - start, length): the visibility of the pair's query rows start..stop."""
        device = self.documents.device
        queries = torch.arange(self.queries + start, self.queries + stop, device=device)
        keys = torch.arange(self.keys, self.keys + self.length, device=device)
        causal = queries[:, None] >= keys[None, :]
        return causal & (self.documents[:, queries, None] == self.documents[:, None, keys])


Mask = Union[Tensor, DocumentMask]  # a whole (B, Tq, Tk) boolean mask, or one built per tile


def mask_rows(mask: Mask, start: int, stop: int) -> Tensor:
    return mask.rows(start, stop) if isinstance(mask, DocumentMask) else mask[:, start:stop]


def tiles(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """(start, stop) of each tile of `rows` query rows (`tile_rows`: TILE_ROWS unless a caller says)."""
    return [(start, min(start + tile_rows, rows)) for start in range(0, rows, tile_rows)]


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


def pair_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Mask],
                 math_pairs: bool = False, tile_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """(output (B, H, Tq, D) in q's dtype, log-sum-exp (B, H, Tq)); a row that sees no key of
    this pair has log-sum-exp -inf (it weighs nothing in the merge). A mask holds causality itself
    (`causal` is not read with one)."""
    if mask is None:
        return _math_forward(q, k, v, causal, None) if math_pairs else _unmasked_forward(q, k, v, causal)
    parts = [_masked_forward(q[:, :, start:stop], k, v, mask_rows(mask, start, stop), math_pairs)
             for start, stop in tiles(q.shape[2], tile_rows or TILE_ROWS)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([out for out, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=-1)


def _unmasked_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    if _flash_applies(q):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., :q.shape[2]]  # padded to a multiple of 32 rows


def _masked_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, math_pairs: bool) -> tuple[Tensor, Tensor]:
    if math_pairs or q.device.type != "cpu":
        return _math_forward(q, k, v, False, mask)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                attn_mask=_additive(mask, q.dtype))
    # the kernel reports 0 for a row with nothing visible
    return out, lse.masked_fill(~mask.any(-1).unsqueeze(1), float("-inf"))


def pair_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  mask: Optional[Mask], math_pairs: bool = False,
                  tile_rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v (k and v with their H_kv heads) of one pair, given the merged output
    and log-sum-exp of the query rows (which make the pair's probabilities the whole row's). Over
    tiles, the key/value gradients are summed in the accumulation dtype."""
    if mask is None:
        if math_pairs:
            return _math_backward(grad_out, q, k, v, out, lse, causal, None)
        return _unmasked_backward(grad_out, q, k, v, out, lse, causal)
    row_tiles = tiles(q.shape[2], tile_rows or TILE_ROWS)
    dqs, dk_sum, dv_sum = [], None, None
    for start, stop in row_tiles:
        dq, dk, dv = _masked_backward(grad_out[:, :, start:stop], q[:, :, start:stop], k, v, out[:, :, start:stop],
                                      lse[..., start:stop], mask_rows(mask, start, stop), math_pairs)
        if len(row_tiles) == 1:
            return dq, dk, dv
        dqs.append(dq)
        acc = accumulation_dtype(k.dtype)  # a running sum: one tile's key/value gradients alive at a time
        dk_sum = dk.to(acc) if dk_sum is None else dk_sum + dk
        dv_sum = dv.to(acc) if dv_sum is None else dv_sum + dv
    return torch.cat(dqs, dim=2), dk_sum.to(k.dtype), dv_sum.to(v.dtype)


def _masked_backward(grad_out, q, k, v, out, lse, mask: Tensor, math_pairs: bool) -> tuple[Tensor, Tensor, Tensor]:
    if math_pairs or q.device.type != "cpu":
        return _math_backward(grad_out, q, k, v, out, lse, False, mask)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, False,
                                                                     attn_mask=_additive(mask, q.dtype))


def _unmasked_backward(grad_out, q, k, v, out, lse, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)
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
