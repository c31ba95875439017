"""Checks of a configuration's values that need no world size and no device (parallel degrees
against a world size are checked in trainer.parallel.dims, the rest before launch in
trainer.preflight). Every problem found is reported in one ConfigError.
"""

from __future__ import annotations

from pathlib import PurePath

from trainer.config.errors import ConfigError
from trainer.config.job_config import JobConfig
from trainer.config.ranges import range_problems


def validate(config: JobConfig) -> None:
    """Check values every run needs; raise ConfigError listing every problem found."""
    from trainer.hf.config_json import read_checked_config  # light: no torch
    from trainer.models.llama3.hf_config import HFConfigError, configured_model_args, flavor_names

    c = config
    problems = range_problems(c)  # every numeric key against what it declares (trainer.config.ranges)
    refused = {problem.split(":")[0] for problem in problems}

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(c.model.flavor in flavor_names(),
         f"model.flavor: {c.model.flavor!r} is unknown; choose one of {', '.join(flavor_names())}")
    if c.model.flavor == "hf" or c.model.hf_assets_path:
        try:
            if c.model.flavor == "hf" and c.model.hf_assets_path:
                read_checked_config(c.model.hf_assets_path)  # each field's type, before the shapes are built
            configured_model_args(c.model)  # the folder itself is checked before launch (preflight.check_data)
        except (HFConfigError, ValueError) as e:
            problems.append(str(e))
    # Cross-key checks compare values their own keys accept: a key already refused is named once.
    if not refused & {"training.loss_scale_min", "training.loss_scale_initial"}:
        need(c.training.loss_scale_min <= c.training.loss_scale_initial,
             f"training.loss_scale_min: must be <= training.loss_scale_initial ({c.training.loss_scale_initial}), "
             f"got {c.training.loss_scale_min}")
    need(not c.metrics.fingerprints or c.metrics.fingerprint_first > 0 or c.metrics.fingerprint_every > 0,
         "metrics.fingerprints: with fingerprint_first = 0 and fingerprint_every = 0 no step is recorded; set "
         "either above 0, or turn fingerprints off")
    prof = c.profiling  # checked also when off: a typo shows at once, not when profiling is turned on
    need(prof.profiler_warmup + prof.profiler_active <= prof.profile_freq,
         f"profiling.profiler_warmup + profiling.profiler_active: {prof.profiler_warmup} + {prof.profiler_active} steps "
         f"must fit in one profiling.profile_freq window of {prof.profile_freq} steps (windows must not overlap); "
         f"lower them or raise profile_freq to at least {prof.profiler_warmup + prof.profiler_active}")
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
    option = ac.selective_ac_option
    # ASCII digits only: int() takes other scripts' digits too, and a number of a few digits at most.
    need(
        option == "op" or (option.isascii() and option.isdigit() and len(option) <= 9 and int(option) >= 1),
        f"activation_checkpoint.selective_ac_option: must be 'op' or a positive integer, got {option!r}",
    )
    p = c.parallelism
    need(p.context_parallel_rotate_method == "allgather",
         f"parallelism.context_parallel_rotate_method: {p.context_parallel_rotate_method!r} is not available; context "
         "parallelism here passes keys and values around a ring; leave the default 'allgather'")
    problems += option_problems(c)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def option_problems(c: JobConfig) -> list[str]:
    """training.dtype and job.save_config_file."""
    problems = []
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
