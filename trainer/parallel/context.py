"""Context parallelism that runs on every backend (gloo on CPU, NCCL on CUDA).

Each of the cp ranks holds 1/cp of every sequence. With a causal mask, late tokens attend to more
keys than early ones, so the sequence is cut into 2 x cp chunks and rank i takes chunks i and
2cp-1-i (head-tail load balancing): every rank then does the same attention work.

Attention is exact: each rank all-gathers the keys and values of its CP group (their gradients are
reduce-scattered back in backward) and masks by the true sequence positions of queries and keys,
so the result is the causal attention of the whole sequence, only computed in pieces. RoPE uses
the same true positions. The K/V all-gather costs memory for the full sequence's keys and
values per rank (not its queries, scores or activations); attention scores stay (T/cp) x T.

The inputs and labels are cut the same way before the forward (`shard_sequence`); the loss of a
rank is the sum over its tokens divided by the global token count, and FSDP sums gradients over
the CP ranks (they are part of the shard mesh), which together give the gradient of the global loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.models.llama3.model import document_causal_mask, grouped_query_attention


def load_balanced_positions(cp_rank: int, cp: int, seq_len: int, device=None) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks cp_rank and 2cp-1-cp_rank of 2cp equal chunks."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of a (B, T, ...) batch, in the order of `load_balanced_positions`."""
    return x.index_select(1, load_balanced_positions(cp_rank, cp, x.shape[1], x.device))


class GatherSequence(torch.autograd.Function):
    """All-gather a (B, T_local, ...) tensor along the sequence over a process group, in rank order;
    backward reduce-scatters (sums) the gradient back to the owner of each piece, in `reduce_dtype`
    (the configured gradient-reduction precision: a bfloat16 sum over ranks loses bits).

    The forward all-gather is a functional collective (it returns a new tensor): selective
    activation checkpointing can then keep its output instead of gathering again in backward
    (trainer/parallel/checkpointing.py). The reduce-scatter is a plain blocking c10d call: on gloo
    the functional one is an allreduce plus a deferred copy that only happens at wait time, and a
    synchronous call keeps the ordering explicit and identical on every backend.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        world = dist.get_world_size(group)
        # Collectives concatenate along dim 0: (world * B, T_local, ...), then move ranks into the sequence.
        functional = torch.ops._c10d_functional
        gathered = functional.wait_tensor(functional.all_gather_into_tensor(x.contiguous(), world, group.group_name))
        return gathered.unflatten(0, (world, -1)).movedim(0, 1).flatten(1, 2)  # (B, world * T_local, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        per_rank = grad.unflatten(1, (world, -1)).movedim(1, 0).flatten(0, 1)  # (world * B, T_local, ...)
        per_rank = per_rank.to(ctx.reduce_dtype or grad.dtype).contiguous()
        local = per_rank.new_empty((per_rank.shape[0] // world, *per_rank.shape[1:]))
        dist.reduce_scatter_single(local, per_rank, op=dist.ReduceOp.SUM, group=ctx.group)
        return local.to(grad.dtype), None, None


class ContextParallelAttention:
    """Attention core (see trainer.models.llama3.model.CausalAttention) of one CP rank."""

    def __init__(self, cp_mesh, reduce_dtype: torch.dtype | None = None):
        self.group, self.reduce_dtype = cp_mesh.get_group(), reduce_dtype
        self.rank, self.degree = cp_mesh.get_local_rank(), cp_mesh.size()

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return load_balanced_positions(self.rank, self.degree, local_len * self.degree, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        local_len = q.shape[1]
        # Keys and values of all CP ranks, concatenated in rank order along the sequence.
        k = GatherSequence.apply(k, self.group, self.reduce_dtype)
        v = GatherSequence.apply(v, self.group, self.reduce_dtype)
        query_positions = self.positions(local_len, q.device)
        key_positions = torch.cat([load_balanced_positions(r, self.degree, local_len * self.degree, q.device)
                                   for r in range(self.degree)])
        if documents is not None:  # the whole sequence's document indices
            return grouped_query_attention(q, k, v, attn_mask=document_causal_mask(documents, query_positions,
                                                                                   key_positions))
        visible = query_positions[:, None] >= key_positions[None, :]  # causal, by true positions
        return grouped_query_attention(q, k, v, attn_mask=visible)


def apply_cp(model: torch.nn.Module, cp_mesh, *, reduce_dtype: torch.dtype | None = None) -> None:
    """Make every attention layer of `model` (a whole Llama or a pipeline stage) context parallel;
    the key/value gradients are reduce-scattered in `reduce_dtype` (None: their own dtype)."""
    for block in model.layers.values():
        block.attention.core = ContextParallelAttention(cp_mesh, reduce_dtype)
