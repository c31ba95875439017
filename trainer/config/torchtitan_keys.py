"""Every key of torchtitan v0.2.2's JobConfig and what this trainer does with it: the data of
the "Coming from torchtitan" table in docs/configuration.md (trainer/config/docs.py renders it).

A key's status is derived, so it cannot drift from the code: a key of this trainer's schema is
the same as torchtitan's unless DIFFERENT says how it differs; a key of IGNORED_SECTIONS or
IGNORED_KEYS is ignored with a warning; any other key must be in REFUSED with the reason (a unit test checks
that every key has exactly one status). Nested torchtitan tables are dotted
(training.dataloader.num_workers is [training.dataloader] num_workers).
"""

from __future__ import annotations

import dataclasses
import typing

from trainer.config.job_config import JobConfig

TORCHTITAN_VERSION = "v0.2.2"

# torchtitan sections and keys this trainer does not implement (v0.2.2's, and a few of earlier
# versions), each with the reason. A config that uses them still loads, from the TOML file or the
# command line alike (so upstream configs and launch scripts work as they are), with one warning
# naming what is ignored. A key here that names a table (quantize.linear.mx) covers every key
# inside it, and an ignored section any key inside it.
MOE = "MoE (experts) only: no effect on a Llama model"
IGNORED_SECTIONS = {
    "fault_tolerance": "torchft's replica groups that survive a failure are not integrated; a failed rank restarts "
                       "the job from its latest checkpoint instead (docs/training.md, automatic restarts)",
    "float8": "torchtitan v0.1's table; v0.2.2's [quantize.linear.float8] is implemented",
    "mx": "torchtitan v0.1's MX table; MX formats are not implemented",
    "experimental": "imports a user's own modules into torchtitan; this trainer builds Llama only",
}
IGNORED_KEYS = {
    "job": {"custom_config_module": "extends torchtitan's configuration class with a user's module; this schema is "
                                    "fixed",
            "use_for_integration_test": "a flag of torchtitan's own test suite",
            "print_args": "an earlier torchtitan's; job.print_config prints the resolved configuration"},
    "quantize": {"linear.mx": "MX formats (MXFP8, for Blackwell GPUs) are not implemented",
                 "grouped_mm": "MoE's grouped matmuls: no effect on a Llama model"},
    "optimizer": {"early_step_in_backward": "the optimizer step inside backward is not implemented (it would clip "
                                            "before the global gradient norm is known)"},
    "training": {"gc_debug": "torchtitan's garbage-collector debugging; Python's gc.set_debug does it"},
    "parallelism": {
        "enable_compiled_autograd": "compiled autograd is not implemented; compile.enable compiles each block's "
                                    "forward and backward",
        "expert_parallel_degree": MOE,
        "expert_tensor_parallel_degree": MOE,
        "expert_parallel_comm_backend": MOE,
        "pipeline_parallel_expert_parallel_overlap": MOE,
        "pipeline_parallel_schedule_csv": "a schedule from a file of actions is not implemented; choose a named "
                                          "schedule",
        "pipeline_parallel_split_points": "an earlier torchtitan's; module_fqns_per_model_part or "
                                          "pipeline_parallel_layers_per_stage split the model",
        "context_parallel_load_balancer": "the ring here always balances the causal work (head and tail chunks)",
    },
    "checkpoint": {"enable_ft_dataloader_checkpoints": "fault tolerance's (torchft) data loader checkpoints",
                   "initial_load_in_hf_quantized": "quantized Hugging Face weights are not read; "
                                                   "initial_load_in_hf reads full-precision safetensors"},
    "activation_checkpoint": {
        "per_op_sac_force_recompute_mm_shapes_by_fqns": "a per-module override of selective op checkpointing (for "
                                                        "MoE routers); not implemented",
        "early_stop": "torch's early stop of recomputation is not exposed",
        "visualize_memory_budget_pareto": "the memory budget's trade-off plot is not implemented",
    },
    "debug": {"moe_force_load_balance": MOE},
}


def why_ignored(section: str, key: str = "") -> str:
    """The reason an ignored `section.key` is ignored (it must be one)."""
    if section in IGNORED_SECTIONS:
        return IGNORED_SECTIONS[section]
    return next(why for ignored, why in IGNORED_KEYS[section].items() if key == ignored or key.startswith(f"{ignored}."))


def is_ignored(section: str, key: str = "") -> bool:
    """Whether `section.key` is an ignored option; `key` is dotted below a table
    ("dataloader.num_workers"), empty for the section itself."""
    return section in IGNORED_SECTIONS or any(key == ignored or key.startswith(f"{ignored}.")
                                              for ignored in IGNORED_KEYS.get(section, ()))

# torchtitan v0.2.2's sections in its JobConfig order, each with its keys in declaration order.
TORCHTITAN_KEYS: dict[str, tuple[str, ...]] = {
    "job": ("config_file", "dump_folder", "description", "print_config", "save_config_file", "custom_config_module"),
    "profiling": ("enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup",
                  "enable_memory_snapshot", "save_memory_snapshot_folder"),
    "metrics": ("log_freq", "enable_tensorboard", "disable_color_printing", "save_tb_folder", "save_for_all_ranks",
                "enable_wandb"),
    "model": ("name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"),
    "optimizer": ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"),
    "lr_scheduler": ("warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"),
    "training": ("dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq",
                 "gc_debug", "dataloader.num_workers", "dataloader.persistent_workers", "dataloader.pin_memory",
                 "dataloader.prefetch_factor"),
    "parallelism": ("data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"),
    "checkpoint": ("enable", "enable_ft_dataloader_checkpoints", "folder", "interval", "initial_load_path",
                   "initial_load_model_only", "initial_load_in_hf", "initial_load_in_hf_quantized",
                   "last_save_model_only", "last_save_in_hf", "export_dtype", "async_mode", "keep_latest_k",
                   "load_step", "exclude_from_loading", "enable_first_step_checkpoint", "create_seed_checkpoint",
                   "load_only"),
    "activation_checkpoint": ("mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
                              "determinism_check", "debug"),
    "compile": ("enable", "components", "backend"),
    "quantize": ("linear.float8.enable_fsdp_float8_all_gather", "linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                 "linear.float8.recipe_name", "linear.float8.filter_fqns", "linear.float8.emulate",
                 "linear.mx.mxfp8_dim1_cast_kernel_choice", "linear.mx.recipe_name", "linear.mx.filter_fqns",
                 "grouped_mm.float8.fqns", "grouped_mm.mx.recipe_name", "grouped_mm.mx.fqns"),
    "comm": ("init_timeout_seconds", "train_timeout_seconds", "trace_buf_size", "save_traces_folder",
             "save_traces_file_prefix", "mode"),
    "memory_estimation": ("enable", "disable_fake_mode"),
    "fault_tolerance": ("enable", "process_group", "process_group_timeout_ms", "replica_id", "group_size",
                        "min_replica_size", "semi_sync_method"),
    "experimental": ("custom_import", "custom_args_module"),
    "validation": ("enable", "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps",
                   "dataloader.num_workers", "dataloader.persistent_workers", "dataloader.pin_memory",
                   "dataloader.prefetch_factor"),
    "debug": ("seed", "deterministic", "deterministic_warn_only", "moe_force_load_balance"),
}

# Keys this trainer implements differently from torchtitan v0.2.2: how.
DIFFERENT: dict[str, str] = {
    "job.config_file": "a bare name is also looked up in train_configs/; the launchers load debug_model.toml "
                       "when it is not given",
    "job.description": "default empty (torchtitan: 'default job')",
    "job.print_config": "prints the resolved configuration as TOML and exits without training (torchtitan logs it "
                        "as JSON and trains)",
    "job.save_config_file": "written as TOML (what job.print_config prints), not JSON; must stay inside "
                            "job.dump_folder, and a file this trainer did not write is never overwritten",
    "model.name": "llama3 only",
    "model.flavor": "debugmodel, 8B, 70B and 405B as in torchtitan, plus tiny, 125M, 1B, 3B and hf (the shapes of "
                    "model.hf_assets_path's config.json); not the flex and varlen attention flavors",
    "model.hf_assets_path": "default empty (torchtitan: ./tests/assets/tokenizer); gives the tokenizer and, with "
                            "flavor hf, the shapes, but not weights: checkpoint.initial_load_in_hf reads "
                            "checkpoint.initial_load_path",
    "model.tokenizer_path": "not deprecated: a tokenizer.json, tiktoken or SentencePiece file; empty: the one of "
                            "model.hf_assets_path",
    "model.converters": "only the float8 converter, named quantize.linear.float8 or float8 (torchtitan's earlier "
                        "name, which its v0.2.2 405B preset still uses); MX is refused",
    "quantize.linear.float8.filter_fqns": "the output projection always stays in high precision, whether named "
                                          "or not",
    "quantize.linear.float8.emulate": "also allowed where float8 kernels exist (a CPU has them)",
    "comm.save_traces_folder": "inside job.dump_folder, as torchtitan; the dumps are NCCL's (CUDA), none on CPU "
                               "(gloo has no flight recorder)",
    "memory_estimation.enable": "runs this trainer's estimator (python -m trainer.estimate) in the launcher before "
                                "the ranks start, for every layout (torchtitan's script: FSDP and HSDP only)",
    "memory_estimation.disable_fake_mode": "the real-tensor estimate runs in the job's own ranks, which then train",
    "parallelism.module_fqns_per_model_part": "the first part must hold tok_embeddings and the last norm and output "
                                              "(the model's ends stay on the first and last stages); JSON on the "
                                              "command line",
    "training.dataloader.num_workers": "the workers compute this rank's rows of the coming global batches, in "
                                       "order (files, shards, built-in sources); streamed datasets read in "
                                       "training.stream_workers instead",
    "validation.dataloader.num_workers": "as training.dataloader.num_workers",
    "optimizer.implementation": "default foreach (torchtitan: fused)",
    "lr_scheduler.warmup_steps": "not shortened to the schedule's length when longer (the peak is then never "
                                 "reached)",
    "lr_scheduler.total_steps": "steps past it train at lr x min_lr_factor (torchtitan extrapolates the decay "
                                "formula)",
    "lr_scheduler.decay_ratio": "the fraction of the steps after warmup (torchtitan: of all steps, warmup "
                                "included); the decay reaches lr x min_lr_factor at the last step (torchtitan stops "
                                "one step short of it)",
    "training.dataset": "default synthetic; also synthetic_context, python_stdlib (built-in real text), shards, files, c4_test (read as files from dataset_path, which "
                        "it needs) and Hugging Face datasets streamed by name (c4, c4_validation, fineweb, "
                        "fineweb-edu, org/name)",
    "training.dataset_path": "its meaning depends on training.dataset (a prepared shard folder, local files, a "
                             "local copy of a Hugging Face dataset)",
    "training.max_norm": "<= 0 turns clipping off, the norm still logged (torchtitan clips to that norm)",
    "training.dtype": "mixed_precision_param float32 or float16 and debug.init_perturbation are refused with "
                      "bfloat16; the initial weights are drawn in float32 and rounded",
    "training.mixed_precision_param": "default auto (bfloat16 on CUDA, float32 on CPU) and also float16 (with "
                                      "loss scaling); applied by FSDP in every layout, never by autocast",
    "training.mixed_precision_reduce": "also bfloat16 and float16; applies to every gradient reduction (FSDP, "
                                       "DDP/HSDP, tensor and context parallelism)",
    "parallelism.pipeline_parallel_schedule": "one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                                              "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
    "parallelism.context_parallel_rotate_method": "only allgather (which runs a ring here); alltoall is refused",
    "checkpoint.initial_load_in_hf": "needs checkpoint.initial_load_path (torchtitan falls back to "
                                     "model.hf_assets_path)",
    "checkpoint.last_save_model_only": "the last save stays a full checkpoint (a finished run can be continued) "
                                       "and also writes the weights alone to step-<N>/model_only/ (torchtitan saves "
                                       "the model only)",
    "checkpoint.last_save_in_hf": "the Hugging Face export is written beside the full last checkpoint, to "
                                  "step-<N>/hf/ (torchtitan saves it instead of DCP)",
    "checkpoint.keep_latest_k": "1 is accepted (torchtitan refuses it): the newest complete checkpoint is "
                                "published only once written",
    "checkpoint.async_mode": "async_with_pinned_mem reuses CPU buffers in the training process (no separate "
                             "process); the last save is always synchronous",
    "activation_checkpoint.mode": "default none (torchtitan: selective); memory_budget needs compile.enable with "
                                  "the model compiled by inductor (torchtitan: compile.enable)",
    "compile.backend": "one of inductor, aot_eager, eager, cudagraphs (torchtitan: any registered name)",
    "validation.dataset": "default empty: the held-out split of training.dataset (torchtitan: c4_validation)",
    "validation.local_batch_size": "default: training.local_batch_size (torchtitan: 8); batches are defined by "
                                   "validation.global_batch_size",
    "validation.seq_len": "default: training.seq_len (torchtitan: 2048)",
    "validation.freq": "default 500 (torchtitan: 10)",
    "validation.steps": "default 10 (torchtitan: -1); -1 needs a files, c4_test, shards or python_stdlib split (refused for "
                        "synthetic, streamed datasets and mixtures) and gives the same loss in every layout",
    "debug.seed": "always set, default 0 (torchtitan: unset, whatever state torch's generator starts in)",
}

# torchtitan v0.2.2 keys refused as unknown here (neither implemented nor ignored): why.
REFUSED: dict[str, str] = {
    "activation_checkpoint.preserve_rng_state": "the model draws no random numbers, so recomputation needs no "
                                                "saved RNG state",
    "activation_checkpoint.determinism_check": "torch's check of recomputed tensors' metadata is not exposed",
    "activation_checkpoint.debug": "torch's recomputation debug traces are not exposed",
    "comm.mode": "only real communication; torchtitan's fake_backend (dry run) and local_tensor modes are not "
                 "implemented",
}

# This trainer's keys that torchtitan v0.2.2 does not have (so every key of the schema is either
# torchtitan's, above, or here: a new key is placed on purpose).
OWN_KEYS: tuple[str, ...] = (
    "optimizer.weight_decay_exclude",
    "training.dataset_text_field", "training.dataset_end", "training.datasets", "training.document_masking",
    "training.document_masking_kernel",
    "training.shuffle", "training.stream_lanes", "training.stream_workers", "training.stream_prefetch",
    "training.data_seed", "training.validation_fraction", "training.loss_scale_initial",
    "training.loss_scale_growth_interval", "training.loss_scale_min",
    "parallelism.tensor_parallel_sync", "parallelism.tensor_parallel_sync_group",
    "checkpoint.accept_data_change", "checkpoint.accept_model_change", "checkpoint.overwrite", "checkpoint.save_on_signal",
    "checkpoint.verify_checksums",
    "metrics.count_collectives", "metrics.peak_flops",
    "metrics.fingerprints", "metrics.fingerprint_first", "metrics.fingerprint_every",
    "debug.init_perturbation", "debug.init_perturbation_seed", "debug.step_delay_s",
    "validation.global_batch_size",
)

SAME, DIFFERENT_STATUS, IGNORED, REFUSED_STATUS = "same", "different", "ignored with a warning", "refused"


def schema_keys() -> set[str]:
    """section.key of every key of this trainer's schema (dotted below a table field:
    quantize.linear.float8.recipe_name)."""

    def keys(cls: type, prefix: str) -> set[str]:
        hints = typing.get_type_hints(cls)
        return {key for f in dataclasses.fields(cls) for key in (
            keys(hints[f.name], f"{prefix}{f.name}.") if dataclasses.is_dataclass(hints[f.name])
            else {f"{prefix}{f.name}"})}

    return keys(JobConfig, "")


def status(key: str, known: set[str] | None = None) -> tuple[str, str]:
    """(status, how or why) of torchtitan's `section.key`; KeyError for a key without one."""
    known = schema_keys() if known is None else known
    section, _, rest = key.partition(".")
    if key in known:
        return (DIFFERENT_STATUS, DIFFERENT[key]) if key in DIFFERENT else (SAME, "")
    if is_ignored(section, rest):
        return IGNORED, why_ignored(section, rest)
    if key in REFUSED:
        return REFUSED_STATUS, REFUSED[key]
    raise KeyError(f"torchtitan's {key} has no status: implement it, list it in IGNORED_KEYS, or give "
                   "the reason it is refused in REFUSED")


def table() -> list[tuple[str, str, str]]:
    """(key, status, how or why) of every torchtitan key, in torchtitan's order."""
    known = schema_keys()
    return [(f"{section}.{key}", *status(f"{section}.{key}", known))
            for section, keys in TORCHTITAN_KEYS.items() for key in keys]
