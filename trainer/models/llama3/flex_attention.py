"""Document-masked attention as a block-sparse kernel: torch's flex attention.

The explicit (B, 1, T, T) mask of `document_causal_mask` keeps SDPA off its flash kernels and
computes every score, also those of blocks that are entirely masked. Flex attention takes the
mask as a rule instead (a key is visible when it is at or before the query and in the same
document), tiles it into 128 x 128 blocks, skips the blocks where nothing is visible and
computes the partly visible ones with the rule applied in the kernel.

CUDA only in training: torch's flex attention has no backward on a CPU (it runs forward there,
which is what the CPU tests compare). Without torch.compile flex attention runs a reference
implementation that builds the whole score matrix, so the kernel is compiled here once; inside
a compiled block the block's own graph takes it in.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled_kernel = None


def document_block_mask(documents: torch.Tensor) -> BlockMask:
    """The block mask of causal attention within documents; documents (B, T) as document_index gives."""
    batch, length = documents.shape

    def same_document_causal(b, h, query, key):
        return (query >= key) & (documents[b, query] == documents[b, key])

    return create_block_mask(same_document_causal, batch, None, length, length, device=documents.device)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            documents: torch.Tensor) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, T, H_kv, D) -> (B, T, H, D): each position attends to the
    earlier positions of its own document; K/V heads are shared by H / H_kv query heads."""
    mask = document_block_mask(documents)
    out = _kernel()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                    enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _kernel():
    if torch.compiler.is_compiling():  # within a compiled block: traced with it
        return flex_attention
    global _compiled_kernel
    if _compiled_kernel is None:
        _compiled_kernel = torch.compile(flex_attention)
    return _compiled_kernel
