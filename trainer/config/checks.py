"""Checks of a configuration's values that need no world size and no device (parallel degrees
against a world size are checked in trainer.parallel.dims, the rest before launch in
trainer.preflight). Every problem found is reported in one ConfigError.
"""

from __future__ import annotations

import math
from pathlib import PurePath

from trainer.config.errors import ConfigError
from trainer.config.job_config import JobConfig
from trainer.config.validation import WHOLE_SPLIT


def validate(config: JobConfig) -> None:
    """Check values every run needs; raise ConfigError listing every problem found."""
    from trainer.models.llama3.hf_config import HFConfigError, configured_model_args, flavor_names  # light: no torch

    c = config
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(c.model.flavor in flavor_names(),
         f"model.flavor: {c.model.flavor!r} is unknown; choose one of {', '.join(flavor_names())}")
    if c.model.flavor == "hf" or c.model.hf_assets_path:
        try:
            configured_model_args(c.model)  # the folder itself is checked before launch (preflight.check_data)
        except (HFConfigError, ValueError) as e:
            problems.append(str(e))
    need(c.training.steps >= 1, f"training.steps: must be >= 1, got {c.training.steps}")
    need(c.training.local_batch_size >= 1, f"training.local_batch_size: must be >= 1, got {c.training.local_batch_size}")
    need(
        c.training.global_batch_size == -1 or c.training.global_batch_size >= 1,
        f"training.global_batch_size: must be -1 (local x data-parallel degree) or >= 1, got {c.training.global_batch_size}",
    )
    need(c.training.seq_len >= 2, f"training.seq_len: must be >= 2, got {c.training.seq_len}")
    need(c.training.stream_lanes >= 1, f"training.stream_lanes: must be >= 1, got {c.training.stream_lanes}")
    need(c.training.stream_workers >= 0, f"training.stream_workers: must be >= 0, got {c.training.stream_workers}")
    need(c.training.stream_prefetch >= 1, f"training.stream_prefetch: must be >= 1, got {c.training.stream_prefetch}")
    for key in ("loss_scale_initial", "loss_scale_min"):
        value = getattr(c.training, key)
        need(value > 0 and math.frexp(value)[0] == 0.5, f"training.{key}: must be a power of two (so that unscaling "
             f"is exact), e.g. 65536 or 1, got {value}")
    need(c.training.loss_scale_min <= c.training.loss_scale_initial,
         f"training.loss_scale_min: must be <= training.loss_scale_initial ({c.training.loss_scale_initial}), "
         f"got {c.training.loss_scale_min}")
    need(c.training.loss_scale_growth_interval >= 1,
         f"training.loss_scale_growth_interval: must be >= 1, got {c.training.loss_scale_growth_interval}")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        need(getattr(c.comm, key) >= 1, f"comm.{key}: must be >= 1 (seconds), got {getattr(c.comm, key)}")
    need(c.training.gc_freq >= 1, f"training.gc_freq: must be >= 1, got {c.training.gc_freq}")
    need(c.optimizer.lr >= 0, f"optimizer.lr: must be >= 0, got {c.optimizer.lr}")
    for key in ("beta1", "beta2"):
        beta = getattr(c.optimizer, key)
        need(0.0 <= beta < 1.0, f"optimizer.{key}: must be in [0, 1), got {beta}")
    need(c.optimizer.eps > 0, f"optimizer.eps: must be > 0, got {c.optimizer.eps}")
    need(c.optimizer.weight_decay >= 0, f"optimizer.weight_decay: must be >= 0, got {c.optimizer.weight_decay}")
    need(c.lr_scheduler.warmup_steps >= 0, f"lr_scheduler.warmup_steps: must be >= 0, got {c.lr_scheduler.warmup_steps}")
    ratio = c.lr_scheduler.decay_ratio
    need(ratio is None or 0.0 <= ratio <= 1.0, "lr_scheduler.decay_ratio: must be in [0, 1] (the share of the steps "
         "after warmup spent decaying; 0 keeps the peak learning rate) or unset (decay over all of them), "
         f"got {ratio}")
    need(
        0.0 <= c.lr_scheduler.min_lr_factor <= 1.0,
        f"lr_scheduler.min_lr_factor: must be in [0, 1], got {c.lr_scheduler.min_lr_factor}",
    )
    need(0 <= c.debug.init_perturbation <= 64, "debug.init_perturbation: must be in [0, 64] rounding errors of the "
         f"compute dtype (1 is the protocol's noise controls; 0 is off), got {c.debug.init_perturbation}")
    need(c.metrics.log_freq >= 1, f"metrics.log_freq: must be >= 1, got {c.metrics.log_freq}")
    need(c.metrics.peak_flops >= 0, f"metrics.peak_flops: must be >= 0, got {c.metrics.peak_flops}")
    need(c.metrics.fingerprint_first >= 0, f"metrics.fingerprint_first: must be >= 0, got {c.metrics.fingerprint_first}")
    need(c.metrics.fingerprint_every >= 0,
         f"metrics.fingerprint_every: must be >= 0 (0: only the first steps), got {c.metrics.fingerprint_every}")
    need(not c.metrics.fingerprints or c.metrics.fingerprint_first > 0 or c.metrics.fingerprint_every > 0,
         "metrics.fingerprints: with fingerprint_first = 0 and fingerprint_every = 0 no step is recorded; set "
         "either above 0, or turn fingerprints off")
    prof = c.profiling  # checked also when off: a typo shows at once, not when profiling is turned on
    need(prof.profile_freq >= 1, f"profiling.profile_freq: must be >= 1, got {prof.profile_freq}")
    need(prof.profiler_warmup >= 0, f"profiling.profiler_warmup: must be >= 0, got {prof.profiler_warmup}")
    need(prof.profiler_active >= 1, f"profiling.profiler_active: must be >= 1, got {prof.profiler_active}")
    need(prof.profiler_warmup + prof.profiler_active <= prof.profile_freq,
         f"profiling.profiler_warmup + profiling.profiler_active: {prof.profiler_warmup} + {prof.profiler_active} steps "
         f"must fit in one profiling.profile_freq window of {prof.profile_freq} steps (windows must not overlap); "
         f"lower them or raise profile_freq to at least {prof.profiler_warmup + prof.profiler_active}")
    need(c.checkpoint.interval >= 1, f"checkpoint.interval: must be >= 1, got {c.checkpoint.interval}")
    need(c.checkpoint.keep_latest_k >= 0, f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {c.checkpoint.keep_latest_k}")
    need(c.checkpoint.load_step >= -1, f"checkpoint.load_step: must be -1 (newest) or a step, got {c.checkpoint.load_step}")
    need(not c.checkpoint.last_save_in_hf or c.checkpoint.enable,
         "checkpoint.last_save_in_hf: needs checkpoint.enable (the export is part of the last save)")
    need(not c.checkpoint.initial_load_in_hf or bool(c.checkpoint.initial_load_path),
         "checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path (the Hugging Face folder)")
    loadable = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    for item in c.checkpoint.exclude_from_loading:
        need(item in loadable, f"checkpoint.exclude_from_loading: {item!r} is unknown; choose from {', '.join(sorted(loadable))}")
    for item in c.compile.components:
        need(item in ("model", "loss"), f"compile.components: {item!r} is unknown; choose from 'model', 'loss'")
    ac = c.activation_checkpoint
    fix = "add 'model' to compile.components" if c.compile.enable else "turn compile.enable on"
    need(ac.mode != "memory_budget" or (c.compile.enable and "model" in c.compile.components),
         "activation_checkpoint.mode: 'memory_budget' lets the compiler choose what compiled blocks recompute, so it "
         f"needs compile.enable with 'model' in compile.components; {fix}, or choose 'full' or 'selective'")
    need(ac.mode != "memory_budget" or c.compile.backend == "inductor",
         f"activation_checkpoint.mode: 'memory_budget' is applied by inductor's partitioner, and compile.backend is "
         f"{c.compile.backend!r}; use 'inductor'")
    need(0.0 <= ac.memory_budget <= 1.0,
         f"activation_checkpoint.memory_budget: must be between 0.0 (recompute the most) and 1.0 (keep every "
         f"activation), got {ac.memory_budget}")
    option = ac.selective_ac_option
    need(
        option == "op" or (option.isdigit() and int(option) >= 1),
        f"activation_checkpoint.selective_ac_option: must be 'op' or a positive integer, got {option!r}",
    )
    p = c.parallelism
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        need(getattr(p, key) >= 1, f"parallelism.{key}: must be >= 1, got {getattr(p, key)}")
    need(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree: must be -1 (the rest of the world) or >= 1, got {p.data_parallel_shard_degree}",
    )
    need(
        p.pipeline_parallel_microbatch_size >= 1,
        f"parallelism.pipeline_parallel_microbatch_size: must be >= 1, got {p.pipeline_parallel_microbatch_size}",
    )
    need(p.context_parallel_rotate_method == "allgather",
         f"parallelism.context_parallel_rotate_method: {p.context_parallel_rotate_method!r} is not available; context "
         "parallelism here passes keys and values around a ring; leave the default 'allgather'")
    for key in ("validation.global_batch_size", "validation.local_batch_size", "validation.seq_len", "validation.freq"):
        section, name = key.split(".")
        need(getattr(getattr(c, section), name) >= 1, f"{key}: must be >= 1, got {getattr(getattr(c, section), name)}")
    need(c.validation.steps >= 1 or c.validation.steps == WHOLE_SPLIT,
         f"validation.steps: must be >= 1 (batches per evaluation) or -1 (the whole validation split), "
         f"got {c.validation.steps}")
    problems += option_problems(c)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def option_problems(c: JobConfig) -> list[str]:
    """lr_scheduler.total_steps, training.dtype and job.save_config_file."""
    problems = []
    total = c.lr_scheduler.total_steps
    if total is not None and total < 1:
        problems.append(f"lr_scheduler.total_steps: must be >= 1, or unset (the schedule spans training.steps), "
                        f"got {total}")
    if c.training.dtype == "bfloat16":
        problems += bfloat16_problems(c)
    if c.job.save_config_file is not None:
        problems += save_config_file_problems(c)
    return problems


def bfloat16_problems(c: JobConfig) -> list[str]:
    """What full bfloat16 training (training.dtype) cannot be combined with."""
    problems = []
    compute = c.training.mixed_precision_param
    if compute == "float32":
        problems.append("training.mixed_precision_param: 'float32' would cast the bfloat16 parameters of "
                        "training.dtype = 'bfloat16' up for compute; use 'auto' or 'bfloat16' (for bfloat16 compute "
                        "over float32 parameters, set training.dtype = 'float32' and mixed_precision_param = "
                        "'bfloat16')")
    elif compute == "float16":
        problems.append("training.mixed_precision_param: 'float16' (computed with dynamic loss scaling) cannot be "
                        "combined with training.dtype = 'bfloat16': the parameters would be rounded to bfloat16 and "
                        "again to float16; use 'auto' or 'bfloat16', or training.dtype = 'float32' for float16 compute")
    if c.debug.init_perturbation:
        problems.append(f"debug.init_perturbation: {c.debug.init_perturbation} rounding errors cannot be applied to "
                        "weights stored in bfloat16 (training.dtype = 'bfloat16'), whose own rounding would swallow "
                        "them; set it to 0, or train with training.dtype = 'float32'")
    return problems


# What a run writes in its dump folder itself (trainer.metrics, trainer.run_record, the launcher's
# logs/, W&B's wandb/): the saved configuration may not take their place.
RUN_OUTPUTS = ("metrics.jsonl", "run_meta.json", "logs", "wandb")


def save_config_file_problems(c: JobConfig) -> list[str]:
    """job.save_config_file must name a file of its own inside the dump folder."""
    name = c.job.save_config_file
    path = PurePath(name)
    key = f"job.save_config_file: {name!r}"
    if not name or name.endswith(("/", "\\")) or path.name in ("", ".", ".."):
        return [f"{key} is not a file name; give one such as 'config.toml' (written in job.dump_folder)"]
    if path.is_absolute() or ".." in path.parts:
        return [f"{key} leaves job.dump_folder; give a file name inside it, such as 'config.toml' (the dump folder "
                "is the run's own, so the file can be replaced at each start)"]
    own = set(RUN_OUTPUTS) | {PurePath(folder).parts[0] for folder in (
        c.checkpoint.folder, c.metrics.save_tb_folder, c.profiling.save_traces_folder,
        c.profiling.save_memory_snapshot_folder) if folder and PurePath(folder).parts}
    if path.parts[0] in own:
        return [f"{key} is where the run writes {path.parts[0]} itself; choose another name, such as 'config.toml'"]
    return []
