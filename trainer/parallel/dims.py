"""Parallel degrees, their validation, and the device mesh they define.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is
innermost so its frequent collectives stay between neighbouring ranks (same node); pipeline
parallelism is outermost because it only sends activations point to point.

Derived (flattened) meshes:
  dp           = dp_replicate x dp_shard   ranks that see different data
  dp_shard_cp  = dp_shard x cp             ranks FSDP shards parameters over
  dp_cp        = dp_replicate x dp_shard x cp  ranks the loss is averaged over

Validation here is pure Python so the launcher can check a config before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.manager import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        """Resolve data_parallel_shard_degree = -1 and check that the degrees multiply to world_size."""
        p = parallelism
        fixed = {
            "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
            "context_parallel_degree": p.context_parallel_degree,
            "tensor_parallel_degree": p.tensor_parallel_degree,
            "pipeline_parallel_degree": p.pipeline_parallel_degree,
        }
        others = 1
        for degree in fixed.values():
            others *= degree
        shard = p.data_parallel_shard_degree
        described = " x ".join(f"{k}={v}" for k, v in fixed.items() if v > 1) or "no other parallelism"
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism: world size {world_size} is not divisible by the product of the other degrees "
                    f"({described} = {others}); launch a multiple of {others} processes (NGPU) or change the degrees"
                )
            shard = world_size // others
        if shard * others != world_size:
            raise ConfigError(
                f"parallelism: data_parallel_shard_degree={shard} x {described} = {shard * others} processes, "
                f"but the world size is {world_size}; set data_parallel_shard_degree = -1 or "
                f"{world_size // others if world_size % others == 0 else 'degrees whose product is the world size'}"
            )
        return cls(p.data_parallel_replicate_degree, shard, p.context_parallel_degree, p.tensor_parallel_degree,
                   p.pipeline_parallel_degree, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of a global rank along each mesh dimension (row-major in MESH_ORDER)."""
        coords = {}
        for name in reversed(MESH_ORDER):
            rank, coords[name] = divmod(rank, getattr(self, name))
        return coords

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel rank whose rows a global rank trains on: equal for all TP/CP/PP peers."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def build_mesh(self, device_type: str) -> "Meshes":
        """The world mesh with named dimensions and the flattened meshes listed in the module doc."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, tuple(self.degrees()[n] for n in MESH_ORDER), mesh_dim_names=MESH_ORDER)
        flattened = {name: world[dims]._flatten(name) for name, dims in FLATTENED.items()}
        return Meshes(world, flattened)


FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class Meshes:
    """The world mesh plus the flattened meshes, which torch wants kept by their creator."""

    def __init__(self, world, flattened: dict):
        self.world, self.flattened = world, flattened

    def __getitem__(self, name: str):
        return self.flattened[name] if name in self.flattened else self.world[name]
