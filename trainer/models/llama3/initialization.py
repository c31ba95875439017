"""Drawing a parameter's initial values the same way in every layout: a generator seeded by
(seed, parameter name), the full tensor drawn, and only this rank's shard kept."""

from __future__ import annotations

import hashlib
import math

import torch


def truncated_normal_(tensor: torch.Tensor, std: float, bound: float, generator: torch.Generator) -> None:
    """Fill with N(0, std^2) truncated to +-bound x std, by the inverse of the normal CDF applied
    to a uniform draw. Unlike nn.init.trunc_normal_ (which redraws rejected values in a loop that
    reads the tensor), its cost and its values do not depend on the data drawn, so it also runs on
    fake tensors (trainer.estimate) and gives the same values whatever torch's own algorithm."""
    edge = math.erf(bound / math.sqrt(2))  # 2 * Phi(bound) - 1
    tensor.uniform_(-edge, edge, generator=generator)
    tensor.erfinv_().mul_(std * math.sqrt(2)).clamp_(-bound * std, bound * std)


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per parameter (Python's hash() changes between processes)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def copy_global_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only the local shard of a DTensor.

    The shard is a slice of the full tensor (local_slices): distribute_tensor would first split
    the full tensor into every rank's chunk, a second full-size copy (8.4 GB more for the 405B
    embedding) and a cost that grows with the world size."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    slices = local_slices(full.shape, param.device_mesh, param.placements)
    if slices is None:  # a placement this rule does not cover
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    else:
        local = full
        for dim, (start, size) in slices.items():
            local = local.narrow(dim, start, size)
    param.to_local().copy_(local)


def local_slices(shape: torch.Size, mesh, placements) -> dict[int, tuple[int, int]] | None:
    """{tensor dim: (start, size)} of this rank's shard of a tensor of `shape` placed on `mesh`,
    or None for placements other than Replicate, Shard and the strided shard FSDP uses over a
    tensor-parallel shard of the same dimension.

    Each Shard cuts its dimension's current range into mesh-size chunks as torch.chunk does
    (ceil(size / n) each, the last ones shorter or empty). A _StridedShard (FSDP over TP) is
    applied after the Shard placements that follow it, which it subdivides: its split factor is
    their product."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = mesh.get_coordinate()
    ranges = {dim: (0, size) for dim, size in enumerate(shape)}
    plain = [i for i, p in enumerate(placements) if not isinstance(p, _StridedShard)]
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    for mesh_dim in plain + strided:
        placement = placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, _StridedShard):
            later = [mesh.size(i) for i in range(mesh_dim + 1, len(placements))
                     if type(placements[i]) is Shard and placements[i].dim == placement.dim]
            if placement.split_factor != math.prod(later):
                return None
        elif type(placement) is not Shard:
            return None
        start, size = ranges[placement.dim]
        chunk = -(-size // mesh.size(mesh_dim))
        first = min(coordinate[mesh_dim] * chunk, size)
        ranges[placement.dim] = (start + first, min(chunk, size - first))
    return ranges
