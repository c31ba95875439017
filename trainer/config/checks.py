"""Checks of a configuration's values that need no world size and no device (parallel degrees
against a world size are checked in trainer.parallel.dims, the rest before launch in
trainer.preflight.checks). Every problem found is reported in one ConfigError.
"""

from __future__ import annotations

import os
from pathlib import PurePath

from trainer.config.errors import ConfigError
from trainer.config.job_config import JobConfig
from trainer.config.ranges import FLOAT32_LARGEST, range_problems, shown
from trainer.float8 import enabled as float8_enabled


def validate(config: JobConfig) -> None:
    """Check values every run needs; raise ConfigError listing every problem found."""
    from trainer.hf.config_json import read_checked_config  # light: no torch
    from trainer.models.llama3.hf_config import HFConfigError, configured_model_args, flavor_names

    c = config
    problems = range_problems(c)  # every numeric key against what it declares (trainer.config.ranges)
    problems += path_problems(c)
    refused = {problem.split(":")[0] for problem in problems}

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(c.model.flavor in flavor_names(),
         f"model.flavor: {shown(c.model.flavor)} is unknown; choose one of {', '.join(flavor_names())}")
    if (c.model.flavor == "hf" or c.model.hf_assets_path) and "model.hf_assets_path" not in refused:
        try:
            if c.model.flavor == "hf" and c.model.hf_assets_path:
                read_checked_config(c.model.hf_assets_path)  # each field's type, before the shapes are built
            configured_model_args(c.model)  # the folder itself is checked before launch (preflight.check_data)
        except (HFConfigError, ValueError) as e:
            problems.append(str(e))
    # Cross-key checks compare values their own keys accept: a key already refused is named once.
    problems += optimizer_problems(c, refused)
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
        need(item in loadable,
             f"checkpoint.exclude_from_loading: {shown(item)} is unknown; choose from {', '.join(sorted(loadable))}")
    for item in c.compile.components:
        need(item in ("model", "loss"), f"compile.components: {shown(item)} is unknown; choose from 'model', 'loss'")
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
        f"activation_checkpoint.selective_ac_option: must be 'op' or a positive integer, got {shown(option)}",
    )
    p = c.parallelism
    need(p.context_parallel_rotate_method == "allgather",
         f"parallelism.context_parallel_rotate_method: {shown(p.context_parallel_rotate_method)} is not available; "
         "context parallelism here passes keys and values around a ring; leave the default 'allgather'")
    problems += option_problems(c)
    problems += float8_problems(c)
    for table, loader in (("training", c.training.dataloader), ("validation", c.validation.dataloader)):
        for key, value in (("prefetch_factor", loader.prefetch_factor), ("persistent_workers", loader.persistent_workers)):
            need(value in (None, False) or loader.num_workers > 0,
                 f"{table}.dataloader.{key}: needs {table}.dataloader.num_workers > 0 (it sets how the workers read "
                 "ahead); set num_workers, or leave it unset")
    need(p.module_fqns_per_model_part is None or p.pipeline_parallel_degree > 1,
         "parallelism.module_fqns_per_model_part: splits the model into pipeline stages; set "
         "parallelism.pipeline_parallel_degree >= 2, or leave it unset")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def optimizer_problems(c: JobConfig, refused: set[str]) -> list[str]:
    """What Adam(W) computes from several keys and hands torch as float32 scalars: the first
    step's size lr / (1 - beta1) (the bias correction is smallest then) and the decay factor
    1 - lr x weight_decay. Beyond float32's range torch stops the first step with "value cannot
    be converted to type float without overflow"."""
    o = c.optimizer
    if refused & {"optimizer.lr", "optimizer.beta1", "optimizer.weight_decay"}:
        return []
    problems = []
    step = o.lr / (1 - o.beta1)  # beta1 < 1
    if step > FLOAT32_LARGEST:
        problems.append(f"optimizer.lr: {o.lr:g} makes the first step's size lr / (1 - optimizer.beta1) = {step:.3g}, "
                        f"beyond float32's largest value 3.4e38 (torch takes it as a float32); lower optimizer.lr")
    if o.lr * o.weight_decay > FLOAT32_LARGEST:
        problems.append(f"optimizer.lr: {o.lr:g} x optimizer.weight_decay {o.weight_decay:g} = "
                        f"{o.lr * o.weight_decay:.3g}, the weight decay of a step, is beyond float32's largest value "
                        "3.4e38 (torch takes it as a float32); lower either")
    return problems


# The keys that name a file or folder (and training.datasets[i].path).
PATH_KEYS = ("job.dump_folder", "job.save_config_file", "model.tokenizer_path", "model.hf_assets_path",
             "training.dataset_path", "checkpoint.folder", "checkpoint.initial_load_path", "metrics.save_tb_folder",
             "profiling.save_traces_folder", "profiling.save_memory_snapshot_folder", "validation.dataset_path",
             "comm.save_traces_folder")
NAME_MAX, PATH_MAX = 255, 4096  # bytes (Linux)


def path_problems(c: JobConfig) -> list[str]:
    """Each path key whose value no system call takes: checked here, so that it is named, instead
    of failing in whichever check first looks at the path."""
    paths = {key: getattr(getattr(c, key.split(".")[0]), key.split(".")[1]) for key in PATH_KEYS}
    paths.update({f"training.datasets[{i}].path": entry.path for i, entry in enumerate(c.training.datasets)})
    return [problem for key, value in paths.items() if value and (problem := path_problem(key, value))]


def path_problem(key: str, value: str) -> str | None:
    """Why `value` names no file (None: it can): a NUL, a name longer than NAME_MAX bytes, a path
    of PATH_MAX bytes, or half of a surrogate pair are refused by every system call."""
    try:
        encoded = os.fsencode(value)
    except UnicodeEncodeError:
        return f"{key}: {shown(value)} is not valid text (it holds half of a surrogate pair), so it names no file"
    if b"\0" in encoded:
        return f"{key}: {shown(value)} holds a NUL character, which no path can"
    longest = max(len(name) for name in encoded.split(b"/"))
    if longest > NAME_MAX or len(encoded) >= PATH_MAX:
        return (f"{key}: {shown(value)} is too long for a path ({len(encoded)} bytes, a name of {longest}); a file or "
                f"folder name has at most {NAME_MAX} bytes, a path fewer than {PATH_MAX}")
    return None


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


# What a run writes in its dump folder itself (trainer.metrics.step_log, trainer.records.run_meta, the launcher's
# logs/, W&B's wandb/): the saved configuration may not take their place.
RUN_OUTPUTS = ("metrics.jsonl", "run_meta.json", "logs", "wandb")


def save_config_file_problems(c: JobConfig) -> list[str]:
    """job.save_config_file must name a file of its own inside the dump folder."""
    name = c.job.save_config_file
    path = PurePath(name)
    key = f"job.save_config_file: {shown(name)}"
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


def float8_problems(c: JobConfig) -> list[str]:
    """[quantize.linear.float8]'s keys against each other (checked with float8 off too, as
    torchtitan's presets carry the table with the converter off), and what float8 layers are not
    combined with."""
    o, key = c.quantize.linear.float8, "quantize.linear.float8"
    problems = []
    if o.recipe_name is not None and o.enable_fsdp_float8_all_gather:
        problems.append(f"{key}.enable_fsdp_float8_all_gather: float8 all-gather is tensorwise scaling's, and "
                        f"recipe_name {o.recipe_name!r} all-gathers in high precision; turn it off, or unset recipe_name")
    if not float8_enabled(c):
        return problems
    if o.emulate and c.compile.enable:
        problems.append(f"{key}.emulate: torchao's emulated float8 matmuls do not compile; turn compile.enable off, or "
                        "emulate off on a GPU with float8 kernels (compute capability 8.9 or later) or a CPU")
    if c.parallelism.tensor_parallel_sync != "full":
        problems.append(f"parallelism.tensor_parallel_sync: {c.parallelism.tensor_parallel_sync!r} computes with each "
                        "rank's local weight shards, which float8 layers (model.converters) do not; use 'full' or "
                        "take float8 off")
    if c.training.enable_cpu_offload:
        problems.append("training.enable_cpu_offload: not combined with float8 layers (model.converters) here: the "
                        "combination has not been tested on a GPU yet; turn one of them off")
    return problems
