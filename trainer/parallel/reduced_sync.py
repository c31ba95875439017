"""Tensor parallelism with fewer synchronizations of the residual stream (sync-point dropping).

Exact tensor parallelism (tensor.py) synchronizes twice per block: the partial sums of the
attention output and of the FFN output are each reduce-scattered into the sequence-split
residual stream, and all-gathered again before the next attention or FFN. Here a rank instead
keeps its own, partial, view of the residual stream for a while and synchronizes once per group
of G consecutive blocks (G = 1: once per block, "per_block"). With x the synchronized stream
entering a group (sequence-split over the TP ranks), for each rank r:

    x_full = all-gather(x)                      once per group, along the sequence
    h_r    = x_full                             the rank's own view of the stream
    for each block of the group:
        a_r = attention_r(norm(h_r))            this rank's heads, through its rows of wo
        f_r = ffn_r(norm(h_r + a_r))            this rank's hidden units, through its rows of w2
        h_r = h_r + a_r + f_r
    out = x + reduce-scatter(h_r - x_full)      once per group: every rank's partial sums added

So the residual stream is the same on every rank at group boundaries, as in exact TP, and inside
a group each rank computes with its own partial sums in place of the full ones. Per group, the
forward pass issues one all-gather and one reduce-scatter; the backward pass the mirror images
(reduce-scatter of the input gradient, all-gather of the output gradient). The norms are
replicated: each rank's norm weights see only that rank's path, so their gradients are summed
over the TP ranks (`ReduceGradient`, in the configured reduce dtype).

Inside a group a block passes (x_full, partial) on instead of a tensor: the group's all-gathered
input and the rank's sum of partial outputs so far. Groups
are counted by global layer index (a group starts at a multiple of G), so a pipeline-parallel run
has the same model as one without, and a stage never ends inside a group (checked at preflight).
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import Partial, Shard, distribute_module, distribute_tensor

from trainer.models.llama3.runtime import NormWeights

SEQUENCE_DIM = 1
# Autograd-aware functional collectives (backward: reduce-scatter, all-gather), under their names
# since torch 2.12 and before it.
_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd


def _shard_linear(linear: torch.nn.Linear, mesh, dim: int) -> None:
    """The linear layer's weight as a DTensor split along `dim`; the block computes with its local
    shard (BlockRuntime.local_shard_weights): no collective, the weight's gradient stays a shard."""
    def partition(name, module, device_mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(dim)])
            module.register_parameter(param_name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))

    distribute_module(linear, mesh, partition)


def _partial_weight(reduce_gradient, weight: torch.Tensor) -> torch.Tensor:
    """A replicated norm weight as a plain tensor whose gradient is this rank's partial sum."""
    return reduce_gradient(weight).to_local(grad_placements=[Partial()])


class GroupSync:
    """A block's forward under reduced synchronization (BlockRuntime.sync): `gathers` for the
    first block of a group, `scatters` for the last (both when G = 1)."""

    def __init__(self, mesh, gathers: bool, scatters: bool):
        self.mesh, self.gathers, self.scatters = mesh, gathers, scatters

    def describe(self) -> str:
        ends = [what for what, on in (("all-gathers its input", self.gathers),
                                      ("reduce-scatters its output", self.scatters)) if on]
        return "reduced over TP " + str(self.mesh.size()) + ": " + (" and ".join(ends) or "passes partial sums on")

    def __call__(self, block, carried, rope: torch.Tensor, documents: torch.Tensor | None):
        if self.gathers:
            x_full, partial_sum = _gather(carried, gather_dim=SEQUENCE_DIM, group=self.mesh), None
        else:
            x_full, partial_sum = carried
        h = x_full if partial_sum is None else x_full + partial_sum
        a = block.attention(block.attention_norm(h), rope, documents)
        f = block.feed_forward(block.ffn_norm(h + a))
        partial_sum = a + f if partial_sum is None else partial_sum + a + f
        if not self.scatters:
            return x_full, partial_sum
        synchronized = _reduce_scatter(partial_sum, "sum", scatter_dim=SEQUENCE_DIM, group=self.mesh)
        return self._own_part(x_full, carried if self.gathers else None) + synchronized

    def _own_part(self, x_full: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of the sequence of the group's input (x when the block has it)."""
        if x is not None:
            return x
        return x_full.chunk(self.mesh.size(), dim=SEQUENCE_DIM)[self.mesh.get_local_rank()]


def apply_reduced_sync(model: torch.nn.Module, tp_mesh, group_size: int, n_layers: int,
                       reduce_gradient: NormWeights) -> tuple[dict[str, GroupSync], NormWeights]:
    """Split the weights of the blocks of `model` (a whole Llama or a pipeline stage) over the TP
    ranks, to be synchronized once per `group_size` blocks: each block's forward (BlockRuntime.sync)
    by block name, and what its norm weights pass through (this rank's partial sums, then
    `reduce_gradient`: their gradient's TP sum, tensor.ReduceGradient)."""
    # Blocks inside a group pass the group's all-gathered input on unchanged, and FSDP hands a
    # block its inputs as views (its backward hook); FSDP warns of in-place writes to such views,
    # and nothing here writes in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    syncs = {}
    for index, block in model.layers.items():
        layer = int(index)
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            _shard_linear(block.get_submodule(name), tp_mesh, dim=0)  # by output features
        for name in ("attention.wo", "feed_forward.w2"):
            _shard_linear(block.get_submodule(name), tp_mesh, dim=1)  # by input features
        for norm in (block.attention_norm, block.ffn_norm):
            distribute_module(norm, tp_mesh)  # replicated
        syncs[index] = GroupSync(tp_mesh, gathers=layer % group_size == 0,
                                 scatters=(layer + 1) % group_size == 0 or layer == n_layers - 1)
    return syncs, NormWeights(f"partial sums, {reduce_gradient.name}", partial(_partial_weight, reduce_gradient.hook))
