"""Parallelisms, each in its own module with one apply_* entry point, composed by `parallelize`.

Composition order, on the model built on the meta device (each step sees what the previous made):
  1. pipeline parallelism: cut the model into this PP rank's stages (pipeline.py, stages.py);
     every later step applies to each stage
  2. tensor + sequence parallelism over the tp mesh, loss parallelism (tensor.py)
  3. context parallelism over the cp mesh: the attention core of every block (context_parallel.py),
     ring attention (ring_attention.py)
  4. activation checkpointing (activation_checkpointing.py)
  5. torch.compile per block (compile.py)
  6. the stage's runtime: what steps 2-5 returned (the attention core, recompute, compile, sync,
     norm-weight handling) and the compute dtype, as one frozen ModelRuntime the model installs
     and its forward reads (trainer/models/llama3/runtime.py; the log prints it)
  7. data parallelism over (dp_replicate, dp_shard x cp): FSDP, HSDP or DDP (fsdp.py); skipped
     for a single process computing in float32, where it would only copy the weights back and
     forth (FSDP over one rank stays when it has work: a lower compute dtype, CPU offload)
Steps 2-5 change no attribute of the model's modules: TP and reduced sync distribute the weights
(torch's DTensor API) and return the rest. TP comes before FSDP so FSDP shards the TP shards
(2-D parameters); AC and compile wrap the blocks FSDP will shard. The trainer then materializes the weights and, under PP, builds the
schedule over the stages (pipeline.Pipeline).

This package imports torch only inside functions: the launcher's preflight imports
trainer.parallel.dims and must stay fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.parallel.dims import ParallelDims, stage_plan
from trainer.parallel.stages import StagePlan

if TYPE_CHECKING:
    import torch

    from trainer.float8 import Float8Conversion
    from trainer.models.llama3.runtime import ModelRuntime

logger = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    model: "torch.nn.Module"  # every parameter this rank holds, under its original name
    stages: dict[int, "torch.nn.Module"]  # what runs: {0: model} without PP, else this rank's stages
    stage_plan: StagePlan | None
    float8: "Float8Conversion | None" = None  # model.converters' float8 layers (trainer/float8.py)


def data_parallel_mesh(dims: ParallelDims, mesh):
    """FSDP's mesh: 1-D (dp_shard x cp), or 2-D (dp_replicate, dp_shard x cp) for HSDP and DDP."""
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]


def parallelize(model, dims: ParallelDims, mesh, config, device) -> ParallelModel:
    """Apply the configured parallelisms to a model built on the meta device."""
    from trainer.float8 import enabled as float8_enabled
    from trainer.parallel.activation_checkpointing import apply_ac
    from trainer.parallel.compile import apply_compile, key_compiled_graphs_by_rank, set_memory_budget
    from trainer.parallel.context_parallel import apply_cp
    from trainer.parallel.fsdp import DTYPES, apply_fsdp, resolve_param_dtype
    from trainer.parallel.pipeline import RankModel, split_into_stages
    from trainer.parallel.tensor import apply_tp, enable_async_tp

    p, ac = config.parallelism, config.activation_checkpoint
    plan = stage_plan(config, dims)
    stages = split_into_stages(model, plan, mesh["pp"].get_local_rank()) if plan else {0: model}
    reshard = p.fsdp_reshard_after_forward
    param_dtype = resolve_param_dtype(config.training.mixed_precision_param, device)
    lower_compute = param_dtype != DTYPES[config.training.dtype]
    # Without FSDP, the model casts its weights to the compute dtype itself (when it differs), but
    # a float8 layer computes with the weight it holds: FSDP over the one rank casts it.
    data_parallel = needs_fsdp(dims, config.training.enable_cpu_offload) or (lower_compute and float8_enabled(config))
    compute_cast = param_dtype if not data_parallel and lower_compute else None
    # Every gradient reduction runs in this dtype: FSDP's, TP's norm weights, CP's keys/values.
    reduce_dtype = DTYPES[config.training.mixed_precision_reduce]
    if config.compile.enable:
        key_compiled_graphs_by_rank(mesh.world.get_rank(), dims.degrees())
        set_memory_budget(ac.memory_budget if ac.mode == "memory_budget" else 1.0)
    for index, stage in stages.items():
        tp = None
        if dims.tp > 1:
            tp = apply_tp(stage, mesh["tp"], loss_parallel=not p.disable_loss_parallel, reduce_dtype=reduce_dtype,
                          sync=p.tensor_parallel_sync, sync_group=p.tensor_parallel_sync_group,
                          n_layers=model.args.n_layers, float8=float8_enabled(config))
        cp_cores = apply_cp(stage, mesh["cp"], reduce_dtype=reduce_dtype) if dims.cp > 1 else None
        recompute = apply_ac(stage, ac.mode, ac.selective_ac_option)
        compiled = (apply_compile(recompute, config.compile.backend)
                    if config.compile.enable and "model" in config.compile.components else None)
        runtime = model_runtime(stage, config.training.document_masking_kernel, tp, cp_cores, recompute, compiled,
                                compute_cast)
        stage.apply_runtime(runtime)
        for line in stage.describe():
            logger.info("runtime%s: %s", f" (stage {index})" if plan else "", line)
        if data_parallel:
            apply_fsdp(
                stage,
                data_parallel_mesh(dims, mesh),
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                reshard_after_forward=reshard == "always" or (reshard == "default" and dims.pp == 1),
                cpu_offload=config.training.enable_cpu_offload,
            )
    if p.enable_async_tensor_parallel:
        enable_async_tp(mesh["tp"], device)
    logger.info("parallelisms: %s", describe(dims, config, plan, data_parallel, compute_cast))
    owned = list(stages.values())
    return ParallelModel(model=owned[0] if len(owned) == 1 else RankModel(owned), stages=stages, stage_plan=plan)


def model_runtime(stage, document_kernel: str, tp, cp_cores: dict | None, recompute: dict, compiled: dict | None,
                  compute_dtype) -> "ModelRuntime":
    """How `stage` computes (trainer/models/llama3/runtime.py), from what each parallelism returned:
    tensor parallelism's parts (`tp`), context parallelism's attention cores, each block's
    recompute and compile, and the compute dtype of a model without FSDP."""
    from trainer.models.llama3.model import CausalAttention
    from trainer.models.llama3.runtime import BlockRuntime, ModelRuntime
    from trainer.parallel.compile import wait_for_collectives

    blocks = []
    for name in stage.layers:
        blocks.append((name, BlockRuntime(
            attention_core=cp_cores[name] if cp_cores else CausalAttention(document_kernel),
            recompute=recompute[name],
            compile=compiled[name] if compiled else None,
            sync=tp.syncs[name] if tp is not None and tp.syncs else None,
            norm_weights=tp.norm_weights if tp is not None else None,
            local_shard_weights=tp is not None and tp.local_shard_weights,
        )))
    return ModelRuntime(
        blocks=tuple(blocks),
        final_norm_weights=tp.final_norm_weights if tp is not None else None,
        compute_dtype=compute_dtype,
        embedding_output=wait_for_collectives if compiled and stage.embeds_tokens else None,
        stage_role=stage.stage_role,
    )


def local_runtime(stage, *, ac_mode: str = "none", ac_option: str = "2", compile_backend: str | None = None,
                  document_kernel: str = "mask", compute_dtype=None) -> "ModelRuntime":
    """The runtime of a model in one process without tensor or context parallelism, from the
    same settings a config gives (activation_checkpoint mode and option, compile backend or None,
    document masking kernel, compute dtype): what tests and benchmarks install by hand."""
    from trainer.parallel.activation_checkpointing import apply_ac
    from trainer.parallel.compile import apply_compile

    recompute = apply_ac(stage, ac_mode, ac_option)
    compiled = apply_compile(recompute, compile_backend) if compile_backend else None
    return model_runtime(stage, document_kernel, None, None, recompute, compiled, compute_dtype)


def needs_fsdp(dims: ParallelDims, cpu_offload: bool) -> bool:
    """FSDP over a world of one shards nothing and reduces nothing: it is only worth its copies
    of the weights when it offloads them. A lower compute dtype is then the model's own cast
    (ModelRuntime.compute_dtype), which gives FSDP's numbers without its per-block copies and
    hooks (on one H100 they left the GPU waiting on the host in every block's forward)."""
    return dims.world_size > 1 or cpu_offload


def sync_phrase(p) -> str:
    if p.tensor_parallel_sync == "full":
        return ""
    if p.tensor_parallel_sync == "per_block":
        return ", synchronized once per block"
    return f", synchronized once per {p.tensor_parallel_sync_group} blocks"


def float8_gathers(config) -> bool:
    """Whether TP gathers the float8 layers' inputs in float8: tensorwise scaling's (float8_tp.py)."""
    from trainer.float8 import enabled as float8_enabled

    return float8_enabled(config) and config.quantize.linear.float8.recipe_name in (None, "tensorwise")


def describe(dims: ParallelDims, config, plan: StagePlan | None, data_parallel: bool = True,
             compute_cast=None) -> str:
    """One line naming what `parallelize` applies, in the order it applies it."""
    p, ac = config.parallelism, config.activation_checkpoint
    parts = []
    if plan is not None:
        parts.append(f"PP {dims.pp} ({plan.schedule}, {plan.num_stages} stages)")
    if dims.tp > 1:
        parts.append(f"TP {dims.tp} with sequence parallelism" + ("" if p.disable_loss_parallel else " and loss parallelism")
                     + (", async" if p.enable_async_tensor_parallel else "") + sync_phrase(p)
                     + (", float8 layers' inputs gathered in float8" if float8_gathers(config) else ""))
    if dims.cp > 1:
        parts.append(f"CP {dims.cp} (load-balanced ring attention)")
    if ac.mode == "memory_budget":
        parts.append(f"activation checkpointing by the compiler (memory budget {ac.memory_budget:g})")
    elif ac.mode != "none":
        parts.append(f"activation checkpointing {ac.mode}" + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else ""))
    if config.compile.enable:
        parts.append(f"torch.compile per block ({config.compile.backend})")
    if not data_parallel:
        parts.append("none (one process: the model runs unwrapped" + (
            f", computing in {str(compute_cast).removeprefix('torch.')})" if compute_cast is not None else ")"))
    elif dims.dp_replicate > 1:
        kind = "DDP" if dims.dp_shard_cp == 1 else "HSDP"
        parts.append(f"{kind} {dims.dp_replicate} replicas x {dims.dp_shard_cp} shards")
    else:
        parts.append(f"FSDP over {dims.dp_shard_cp} rank" + ("s" if dims.dp_shard_cp > 1 else ""))
    return ", ".join(parts)
