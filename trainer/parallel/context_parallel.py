"""Context parallelism that runs on every backend (gloo on CPU, NCCL on CUDA).

Each of the cp ranks holds 1/cp of every sequence. With a causal mask, late tokens attend to more
keys than early ones, so the sequence is cut into 2 x cp chunks and rank i takes chunks i and
2cp-1-i (head-tail load balancing): every rank then does the same attention work.

Attention is exact and runs as a ring (trainer/parallel/ring_attention.py): each rank keeps its
query chunks while the keys and values of the CP group pass from rank to rank, one hop per step;
each (query chunk, key chunk) pair is fully visible, causal (the diagonal) or skipped, by true
chunk positions, and the partial results are merged by log-sum-exp. Backward sends the keys and
values around again, and their gradients travel with them back to their owners, summed in the
configured gradient-reduction precision. No rank ever holds more than two ranks' keys and values,
and no (T/cp) x T mask or score matrix exists: memory is O(T/cp) per rank. RoPE uses the true
positions. Document masking is exact: pairs that cross a document boundary run with their own
mask (trainer/parallel/ring_attention.py, `block_calls`).

The inputs and labels are cut the same way before the forward (`shard_sequence`); the loss of a
rank is the sum over its tokens divided by the global token count, and FSDP sums gradients over
the CP ranks (they are part of the shard mesh), which together give the gradient of the global loss.
"""

from __future__ import annotations

import torch

from trainer.parallel.ring_attention import ring_attention


def load_balanced_positions(cp_rank: int, cp: int, seq_len: int, device=None) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks cp_rank and 2cp-1-cp_rank of 2cp equal chunks."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of a (B, T, ...) batch, in the order of `load_balanced_positions`."""
    return x.index_select(1, load_balanced_positions(cp_rank, cp, x.shape[1], x.device))


class ContextParallelAttention:
    """Attention core (see trainer.models.llama3.model.CausalAttention) of one CP rank: ring
    attention over the CP group; key/value gradients summed in `reduce_dtype` (None: their own)."""

    def __init__(self, cp_mesh, reduce_dtype: torch.dtype | None = None):
        self.group, self.reduce_dtype = cp_mesh.get_group(), reduce_dtype
        self.rank, self.degree = cp_mesh.get_local_rank(), cp_mesh.size()

    def describe(self) -> str:
        dtype = str(self.reduce_dtype).removeprefix("torch.") if self.reduce_dtype is not None else "their dtype"
        return f"ring over CP {self.degree} (load-balanced chunks), K/V gradients summed in {dtype}"

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return load_balanced_positions(self.rank, self.degree, local_len * self.degree, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, T/cp, H, D), k and v (B, T/cp, H_kv, D) of this rank's chunks; documents (B, T)
        over the whole sequence, when given -> (B, T/cp, H, D)."""
        out, _ = ring_attention(q, k, v, documents, self.group.group_name, self.rank, self.degree,
                                self.reduce_dtype)
        return out


def apply_cp(model: torch.nn.Module, cp_mesh, *, reduce_dtype: torch.dtype | None = None) -> dict:
    """The context-parallel attention core of every block of `model` (a whole Llama or a pipeline
    stage), by block name (BlockRuntime.attention_core); the key/value gradients travel back to
    their owners in `reduce_dtype` (None: their own dtype)."""
    return {name: ContextParallelAttention(cp_mesh, reduce_dtype) for name in model.layers}
