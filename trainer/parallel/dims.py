"""Parallel degrees, their validation, and the device mesh they define.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is
innermost so its frequent collectives stay between neighbouring ranks (same node); pipeline
parallelism is outermost because it only sends activations point to point.

Derived (flattened) meshes:
  dp           = dp_replicate x dp_shard   ranks that see different data
  dp_shard_cp  = dp_shard x cp             ranks FSDP shards parameters over
  dp_cp        = dp_replicate x dp_shard x cp  ranks the loss is averaged over

Validation here is pure Python so the launcher can check a config before any process starts:
`ParallelDims.from_config` checks the degrees against the world size, `layout_problems` checks
them against the model, the batch and the other options, naming the fix for each problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.manager import ConfigError
from trainer.parallel.stages import (V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, StageError, StagePlan, accumulation_steps,
                                     check_microbatches, plan_stages)

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
        named = [f"{k}={v}" for k, v in fixed.items() if v > 1]
        described = " x ".join(named) or "no other parallelism"
        if shard == -1:
            if world_size % others:
                product = described + (f" = {others}" if len(named) > 1 else "")
                raise ConfigError(
                    f"parallelism: world size {world_size} is not divisible by the product of the other degrees "
                    f"({product}); launch a multiple of {others} processes (NGPU, or --nproc) or change the degrees"
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

    @property
    def dp_shard_cp(self) -> int:
        """Ranks FSDP shards parameters over: context-parallel ranks join the shard group."""
        return self.dp_shard * self.cp

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

    def __getitem__(self, name: str | tuple[str, ...]):
        """A named or flattened dimension, or several of them (a tuple) as one mesh."""
        if isinstance(name, str) and name in self.flattened:
            return self.flattened[name]
        return self.world[name]


# ---------------------------------------------------------------------------------------------
# The layout against the model, the batch and the other options


def stage_plan(config, dims: ParallelDims) -> StagePlan | None:
    """The pipeline stage split of this layout (None without pipeline parallelism)."""
    if dims.pp == 1:
        return None
    from trainer.models.llama3.hf_config import configured_model_args

    p = config.parallelism
    return plan_stages(configured_model_args(config.model).n_layers, dims.pp, p.pipeline_parallel_schedule,
                       p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_first_stage_less_layers,
                       p.pipeline_parallel_last_stage_less_layers, p.module_fqns_per_model_part)


def layout_problems(config, dims: ParallelDims) -> list[str]:
    """Every reason the degrees cannot run this model and batch, each with the fix."""
    from trainer.models.llama3.hf_config import configured_model_args

    c, p = config, config.parallelism
    model = configured_model_args(c.model)
    problems = []
    if dims.tp > 1:
        for what, size in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads),
                           ("vocab_size", model.vocab_size), ("FFN hidden size", model.ffn_hidden_dim)):
            if size % dims.tp:
                problems.append(f"parallelism.tensor_parallel_degree={dims.tp}: the {c.model.flavor} model's {what} "
                                f"({size}) is not divisible by it; choose a degree that divides {size}")
    seq_lens = {"training.seq_len": c.training.seq_len}
    if c.validation.enable:
        seq_lens["validation.seq_len"] = c.validation.seq_len
    for key, seq_len in seq_lens.items():
        problems += sequence_problems(key, seq_len, dims)
    problems += sync_problems(config, dims, model.n_layers)
    if c.training.document_masking and c.training.document_masking_kernel == "flex" and dims.tp > 1:
        # Flex attention runs on CUDA only and this project's multi-rank tests on CPUs: the two have
        # never been checked together, so the combination is refused rather than run unchecked.
        problems.append(f"training.document_masking_kernel: 'flex' is not available with tensor parallelism "
                        f"(tensor_parallel_degree={dims.tp}); use 'mask', or tensor_parallel_degree 1")
    if c.training.document_masking and c.training.document_masking_kernel == "flex" and dims.cp > 1:
        problems.append(f"training.document_masking_kernel: 'flex' does not apply under context parallelism "
                        f"(context_parallel_degree={dims.cp}): the ring attention masks documents itself, a tile of "
                        "query rows at a time; use 'mask', or context_parallel_degree 1")
    if p.enable_async_tensor_parallel and (dims.tp == 1 or not c.compile.enable):
        problems.append("parallelism.enable_async_tensor_parallel: needs tensor_parallel_degree > 1 and "
                        "compile.enable (it is a compiler pass), on CUDA")
    if dims.pp > 1:
        problems += pipeline_problems(config, dims)
        if model.tie_embeddings and p.pipeline_parallel_schedule in V_SCHEDULES:
            problems.append(
                f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule!r}: a V-shaped schedule puts "
                f"the first and the last stage on one rank, which the {c.model.flavor} model's tied embedding and "
                "output cannot share; choose another schedule (e.g. Interleaved1F1B)")
    return problems


def sync_problems(config, dims: ParallelDims, n_layers: int) -> list[str]:
    """The reduced tensor-parallel synchronizations need TP ranks to drop syncs between, a group
    size only with "grouped", and groups that end where pipeline stages end (a stage sends one
    synchronized hidden state to the next)."""
    p = config.parallelism
    sync, group = p.tensor_parallel_sync, p.tensor_parallel_sync_group
    if sync != "grouped":
        problems = [] if group == 0 else [
            f"parallelism.tensor_parallel_sync_group={group}: only used with tensor_parallel_sync = \"grouped\" "
            f"(it is {sync!r}); remove it or set tensor_parallel_sync = \"grouped\""]
    elif not 1 <= group <= n_layers:
        problems = [f"parallelism.tensor_parallel_sync_group={group}: tensor_parallel_sync = \"grouped\" needs the "
                    f"number of blocks per synchronization, 1 to the model's {n_layers} layers"]
    else:
        problems = []
    if sync != "full" and dims.tp == 1:
        problems.append(f"parallelism.tensor_parallel_sync={sync!r}: drops tensor-parallel synchronizations, but "
                        "tensor_parallel_degree is 1 (nothing to drop); set tensor_parallel_degree > 1 or use \"full\"")
    if sync != "full" and dims.pp > 1 and not problems:
        problems += group_stage_problems(config, dims, sync_group_size(sync, group), n_layers)
    if sync != "full" and config.checkpoint.last_save_in_hf and not config.checkpoint.accept_model_change:
        problems.append(f"checkpoint.last_save_in_hf: the Hugging Face export is the exact Llama, in which weights "
                        f"trained with parallelism.tensor_parallel_sync={sync!r} compute another function than the "
                        "one trained; leave last_save_in_hf off, or set checkpoint.accept_model_change = true to "
                        "export them anyway")
    return problems


def sync_group_size(sync: str, group: int) -> int:
    """Blocks per tensor-parallel synchronization of the reduced variants (per_block: 1)."""
    return group if sync == "grouped" else 1


def group_stage_problems(config, dims: ParallelDims, group: int, n_layers: int) -> list[str]:
    try:
        plan = stage_plan(config, dims)
    except StageError:
        return []  # pipeline_problems reports it
    for stage, blocks in enumerate(plan.blocks):
        if not blocks:
            continue
        starts_a_group = blocks[0] % group == 0
        ends_a_group = (blocks[-1] + 1) % group == 0 or blocks[-1] == n_layers - 1
        if not (starts_a_group and ends_a_group):
            return [f"parallelism.tensor_parallel_sync_group={group}: pipeline stage {stage} holds layers "
                    f"{blocks[0]}-{blocks[-1]}, which cuts a group of {group} blocks (groups start at multiples of "
                    f"{group}); choose a group size that divides every stage's layers, or set "
                    "pipeline_parallel_layers_per_stage to a multiple of it"]
    return []


def sequence_problems(key: str, seq_len: int, dims: ParallelDims) -> list[str]:
    """Context parallelism cuts each sequence into 2 x cp chunks (head-tail load balancing);
    sequence parallelism then splits each rank's part over the TP ranks."""
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        return [f"{key}={seq_len}: context_parallel_degree={dims.cp} splits sequences into 2 x {dims.cp} equal "
                f"chunks; use a multiple of {2 * dims.cp}"]
    local = seq_len // dims.cp
    if dims.tp > 1 and local % dims.tp:
        multiple = dims.tp * (2 * dims.cp if dims.cp > 1 else 1)
        return [f"{key}={seq_len}: sequence parallelism splits each rank's {local} tokens over "
                f"tensor_parallel_degree={dims.tp} ranks; use a multiple of {multiple}"]
    return []


def pipeline_problems(config, dims: ParallelDims) -> list[str]:
    c, p = config, config.parallelism
    try:
        plan = stage_plan(config, dims)
        check_microbatches(p.pipeline_parallel_schedule, c.training.local_batch_size,
                           p.pipeline_parallel_microbatch_size, dims.pp, plan.num_stages,
                           accumulation_steps(c.training.global_batch_size, c.training.local_batch_size, dims.dp))
    except StageError as e:
        return [str(e)]
    problems = []
    if c.compile.enable and "model" in c.compile.components and p.pipeline_parallel_schedule in ZERO_BUBBLE_SCHEDULES:
        problems.append(f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule}: zero-bubble "
                        "schedules split backward in two, which torch.compile does not support; disable compile.enable "
                        "or choose Interleaved1F1B")
    if c.validation.enable and (c.validation.local_batch_size, c.validation.seq_len) != (
            c.training.local_batch_size, c.training.seq_len):
        problems.append("validation.local_batch_size / validation.seq_len: under pipeline parallelism validation runs "
                        "through the training pipeline, so they must equal training.local_batch_size "
                        f"({c.training.local_batch_size}) and training.seq_len ({c.training.seq_len})")
    elif c.validation.enable:  # validation runs one local batch per schedule step, without accumulation
        try:
            check_microbatches(p.pipeline_parallel_schedule, c.training.local_batch_size,
                               p.pipeline_parallel_microbatch_size, dims.pp, plan.num_stages)
        except StageError as e:
            problems.append(f"validation.enable: validation runs one local batch per pipeline schedule step: {e}")
    if c.training.document_masking:
        problems.append("training.document_masking: not available with pipeline parallelism (the stages after the "
                        "first do not see the tokens that mark documents); set pipeline_parallel_degree 1 or turn it off")
    return problems
