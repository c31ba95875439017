"""Checks of a configuration against a world size, before any process group exists.

`python -m trainer.preflight --nproc N --device cpu|cuda [--nproc-per-node K] [overrides]` runs them in
one light process (no torch import); the launcher (trainer/launch/launcher.py) runs the same checks in its
own process before starting any rank, so a user's mistake gets one clear message instead of one
traceback per rank. The trainer repeats the layout checks in every rank.

The host memory check compares what the processes of one machine will hold in CPU memory, counted
from the model's shapes without building it, with MemAvailable of /proc/meminfo.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer import float8, messages

from trainer.records import run_meta
from trainer.checkpoint.on_disk import check_load_options, checkpoint_folder, complete_checkpoints, initial_load_folder
from trainer.checkpoint.lineage import LINEAGE_FILE
from trainer.preflight.data import check_data
from trainer.preflight.resume import RunComplete, check_resume, complete_record, resume_candidate  # noqa: F401 (used from here)
from trainer.config.job_config import JobConfig
from trainer.preflight.step_bound import (DTYPE_BYTES, ActivationBound, activation_bound, check_device_memory,
                                         gpu_memory, state_bytes_per_parameter)
from trainer.config.manager import ConfigError, load_config, with_default_config
from trainer.config.saved_config import check_saved_config_file
from trainer.parallel.dims import ParallelDims, layout_problems
from trainer.records.safe_writes import LinkRefused, refuse_link

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    dims: ParallelDims
    global_batch_size: int
    accumulation_steps: int


def check_device_options(config: JobConfig, device_type: str) -> None:
    """Options that only make sense with accelerators."""
    if device_type == "cpu":
        if config.training.enable_cpu_offload:
            raise ConfigError("training.enable_cpu_offload: moves FSDP state from GPU to CPU memory; this run is on "
                              "the CPU already, where it has nothing to offload")
        if config.parallelism.enable_async_tensor_parallel:
            raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory)")
        if config.compile.enable and config.compile.backend == "cudagraphs":
            raise ConfigError("compile.backend: 'cudagraphs' replays CUDA graphs, and this run is on the CPU; use "
                              "'inductor'")
        if config.training.document_masking and config.training.document_masking_kernel == "flex":
            raise ConfigError("training.document_masking_kernel: 'flex' (torch's flex attention) has no backward on "
                              "the CPU, and this run is on the CPU; use 'mask'")
    if config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError(f"profiling.enable_memory_snapshot: records the CUDA caching allocator, so it needs CUDA "
                          f"devices, and this run is on the {device_type.upper()}; turn it off "
                          "(profiling.enable_profiling traces CPU runs)")


def check_wandb_installed(config: JobConfig) -> None:
    """metrics.enable_wandb needs the optional wandb package: say so before any process starts."""
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.enable_wandb: the wandb package is not installed in {sys.executable}; install "
                          f"it from the repository root with {sys.executable} -m pip install -e '.[wandb]', or turn "
                          "metrics.enable_wandb off")


def check_torchao_installed(config: JobConfig) -> None:
    """model.converters' float8 needs the optional torchao package: say so before any process starts."""
    if float8.enabled(config) and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"model.converters: float8 layers need the torchao package, which is not installed in "
                          f"{sys.executable}; install it from the repository root with {sys.executable} -m pip install "
                          "-e '.[float8]', or take float8 out of model.converters")


def plan_run(config: JobConfig, world_size: int) -> RunPlan:
    """Resolve parallel degrees and the batch split; raise ConfigError naming the key to fix."""
    check_wandb_installed(config)
    check_torchao_installed(config)
    check_saved_config_file(config)
    check_data(config)
    try:
        check_load_options(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    plan = plan_layout(config, world_size)
    check_stream_lanes(config, plan.dims, plan.global_batch_size)
    if config.metrics.count_collectives and config.compile.enable:
        raise ConfigError("metrics.count_collectives: counts in eager mode (a dispatch mode sees every operation), and "
                          "torch.compile does not compile under it; turn compile.enable off for the run that counts")
    return plan


def plan_layout(config: JobConfig, world_size: int) -> RunPlan:
    """The degrees and the batch split alone, checked against the model and the batch: what
    `python -m trainer.estimate` needs of a job (its data and files may be on another machine)."""
    dims = ParallelDims.from_config(config.parallelism, world_size)
    problems = layout_problems(config, dims)
    if problems:
        raise ConfigError(f"parallel layout {describe_degrees(dims)} does not fit this job:\n  " + "\n  ".join(problems))
    local = config.training.local_batch_size
    per_pass = local * dims.dp
    global_batch = config.training.global_batch_size
    if global_batch == -1:
        global_batch = per_pass
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size: {global_batch} is not a multiple of local_batch_size {local} x "
            f"data-parallel degree {dims.dp} = {per_pass}; use a multiple of {per_pass} or -1"
        )
    return RunPlan(dims=dims, global_batch_size=global_batch, accumulation_steps=global_batch // per_pass)


def check_stream_lanes(config: JobConfig, dims: ParallelDims, global_batch: int) -> None:
    """A streamed dataset's lanes must split every global batch; they share the reading evenly
    only as a multiple of the data-parallel degree (else some ranks read lanes they share)."""
    from trainer.data.build import is_streamed

    lanes = config.training.stream_lanes
    if not is_streamed(config.training.dataset) or config.training.datasets:
        return
    if global_batch % lanes:
        raise ConfigError(f"training.stream_lanes: {lanes} lanes do not split the global batch of {global_batch} "
                          f"sequences; use a divisor of it (a multiple of the data-parallel degree {dims.dp} shares "
                          "the reading evenly)")
    if lanes % dims.dp:
        logger.info("training.stream_lanes: %d lanes over %d data-parallel ranks: ranks read whole lanes even where "
                    "they train on part of one; a multiple of %d shares the reading evenly", lanes, dims.dp, dims.dp)


def describe_degrees(dims: ParallelDims) -> str:
    return "(" + " ".join(f"{k}={v}" for k, v in dims.degrees().items()) + ")"


# ---------------------------------------------------------------------------------------------
# Host memory

MEMINFO = "/proc/meminfo"
FP32_BYTES = 4


@dataclass(frozen=True)
class MemoryNeed:
    """Host (CPU) memory the processes of this machine will hold at least, and why."""

    bytes: int
    what: str  # what holds it: "<who> holds <what> (<figures>)"
    advice: str  # what to do when it does not fit
    activations: ActivationBound | None = None  # of one step per process (step_bound.py), when counted
    procs: int = 1  # the processes that hold activations


def gb(n: float) -> str:
    """Bytes in GB (1e9), or MB below 1 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def count(n: int) -> str:
    """8030261248 -> '8.03e9'."""
    mantissa, exponent = f"{n:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def model_sizes(config: JobConfig) -> tuple[int, int]:
    """(parameters, elements of the largest parameter) of the configured model, from its shapes alone."""
    from trainer.models.llama3.args import num_params
    from trainer.models.llama3.hf_config import configured_model_args

    args = configured_model_args(config.model)
    largest = args.dim * max(args.vocab_size, args.ffn_hidden_dim, args.n_heads * args.head_dim)
    return num_params(args), largest


INIT_TEMPORARIES = 1  # full-size temporaries of the largest parameter while it is initialized


def seed_memory_need(config: JobConfig) -> MemoryNeed:
    """The seed checkpoint: one process builds the whole model in float32 on the CPU. Initializing
    a parameter draws it as one full-size float32 tensor, filled in place (Transformer.init_weights;
    `python -m trainer.estimate --host` measures the same on fake tensors). Measured peak resident
    memory for the 1B flavor: 5.24 GB (4.94 GB of weights, largest parameter 1.05 GB, about 0.3 GB
    for Python and torch): below this count, as weights not yet drawn are not resident."""
    params, largest = model_sizes(config)
    return MemoryNeed(
        bytes=FP32_BYTES * (params + INIT_TEMPORARIES * largest),
        what=(f"creating the seed checkpoint builds the whole model in this one process in float32 "
              f"({count(params)} parameters x 4 bytes, plus {INIT_TEMPORARIES} init buffers of the largest one)"),
        advice=("create it on a machine with that much free memory and copy the step-0 folder; or start the "
                "runs without a seed checkpoint (debug.seed alone gives every FSDP layout the same initial "
                "weights on one device type)"),
    )


def hf_folder_bytes(path: Path) -> int:
    """Bytes of the safetensors files of a Hugging Face folder (what each rank reads in full)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


def loads_hf_folder(config: JobConfig) -> bool:
    """Whether the run will read checkpoint.initial_load_path as a Hugging Face folder: only when
    there is no checkpoint of its own to resume from."""
    c = config.checkpoint
    if not (c.initial_load_path and c.initial_load_in_hf):
        return False
    return not (c.enable and (c.load_step != -1 or complete_checkpoints(checkpoint_folder(config))))


def training_memory_need(config: JobConfig, dims: ParallelDims, device_type: str,
                         local_procs: int) -> MemoryNeed | None:
    """What the `local_procs` processes of one machine hold in host memory, at least: on a CPU
    the model state (parameters, gradients, Adam state in training.dtype: 16 bytes per parameter
    in float32, 8 in bfloat16, over
    the ranks of one replica whatever the sharding, times dp_replicate); with
    checkpoint.initial_load_in_hf, on any device, every rank's full copy of the safetensors files.
    None when neither applies (the model state lives on the accelerators)."""
    params, largest = model_sizes(config)
    world = dims.world_size
    share = min(local_procs, world) * dims.dp_replicate / world  # of one full model state
    c = config.checkpoint  # the Hugging Face folder itself, or the hf/ export of a step-N folder
    hf = initial_load_folder(Path(c.initial_load_path), True) if loads_hf_folder(config) else None
    hf_bytes = hf_folder_bytes(hf) if hf is not None else 0
    parts, advice = [], []
    state, activations = 0, None
    if device_type == "cpu":
        # Weights exist from init on; gradients and Adam state from the first step.
        dtype = config.training.dtype
        per_parameter = state_bytes_per_parameter(config)
        state = int(per_parameter * params * share)
        init = local_procs * FP32_BYTES * largest  # init_weights' full-size float32 buffer, per process
        activations = activation_bound(config, dims.tp, dims.cp, dims.pp, device_type)
        parts.append(f"parameters, gradients and Adam state in {dtype} ({count(params)} parameters x "
                     f"{per_parameter} bytes{f' x {share:g}' if share != 1 else ''}, plus each process's init buffer), "
                     f"and a step's activations ({gb(activations.bytes)} per process at least, {activations.tokens:,} "
                     "tokens)")
        need = state + init + min(local_procs, world) * activations.bytes
        advice.append("use a smaller model.flavor, or train on GPUs")
        if hf_bytes:
            need = max(need, int(DTYPE_BYTES[dtype] * params * share) + init + local_procs * hf_bytes)
    elif hf_bytes:
        need = local_procs * hf_bytes
    else:
        return None
    if hf_bytes:
        parts.append(f"each process's full copy of {hf} ({gb(hf_bytes)}) while loading it")
        advice.append(f"convert the folder once (python -m trainer.hf import --hf {hf} "
                      f"--flavor {config.model.flavor} --out DIR) and load DIR as a DCP checkpoint")
    who = f"{local_procs} process{'es' if local_procs > 1 else ''} on {device_type}"
    return MemoryNeed(bytes=need, what=f"{who} hold {' and '.join(parts)}", advice="; or ".join(advice),
                      activations=activations, procs=min(local_procs, world))


def fitting_step(config: JobConfig, need: MemoryNeed, available: int) -> str:
    """What would bring a step's activations (trainer/preflight/step_bound.py) within `available`
    bytes: the longest training.seq_len its bound allows, a smaller batch, or checkpointing."""
    bound = need.activations
    room = available - (need.bytes - need.procs * bound.bytes)  # for the activations of all processes
    limit = bound.seq_len_limit(max(0, room) // need.procs, config.training.seq_len, " here")
    return (f"a shorter training.seq_len{limit}, a smaller training.local_batch_size, or "
            "activation_checkpoint.mode 'full'")


def available_memory(meminfo: str | Path | None = None) -> int | None:
    """MemAvailable of /proc/meminfo (or `meminfo`) in bytes: memory the kernel can give without
    swapping. None where it cannot be read (macOS, a container without /proc)."""
    try:
        with open(meminfo or MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(config: JobConfig, need: MemoryNeed | None, meminfo: str | Path | None = None) -> None:
    """ConfigError when the memory a run needs at least is more than the machine has available.

    The need counts only what grows with the model (parameters, gradients, optimizer state, full
    copies while loading), none of the per-process overhead (the interpreter and torch, about
    0.3 GB each), activations or allocator slack: a run refused here cannot fit, and no run
    that could fit is refused. A run that passes may still run out of memory; the launcher then
    names the kernel's out-of-memory killer and this figure.
    """
    if need is None or os.environ.get("TRAINER_SKIP_MEMORY_CHECK"):
        return
    available = available_memory(meminfo)
    if available is None or need.bytes <= available:
        return
    advice = need.advice if need.activations is None else f"{fitting_step(config, need, available)}; or {need.advice}"
    raise ConfigError(
        f"model.flavor {config.model.flavor}: {need.what}: {gb(need.bytes)} of host memory, but this machine has "
        f"{gb(available)} available (MemAvailable in {meminfo or MEMINFO}); {advice}. (To try anyway: "
        "TRAINER_SKIP_MEMORY_CHECK=1)")


def say_unused_hf_shapes(config: JobConfig) -> None:
    """A config.json in model.hf_assets_path describes a model; with a shipped model.flavor it is
    not used (the folder may be there for its tokenizer only): say so when the shapes differ."""
    from trainer.models.llama3.hf_config import (HFConfigError, configured_model_args, hf_config_differences,
                                                 read_config_json)

    folder = config.model.hf_assets_path
    if config.model.flavor == "hf" or not folder or not (Path(folder) / "config.json").is_file():
        return
    source = f"{folder}/config.json"
    try:
        differences = hf_config_differences(read_config_json(folder), configured_model_args(config.model), source)
    except HFConfigError as e:  # fields this model cannot follow at all
        differences = [str(e)]
    if differences:
        logger.warning("model.hf_assets_path: the shapes of model.flavor %s are used, not those of its config.json "
                       "(model.flavor = \"hf\" trains the folder's model): %s: %s", config.model.flavor, source,
                       "; ".join(differences))


def check_seed(config: JobConfig, meminfo: str | Path | None = None) -> None:
    """The seed checkpoint's checks: an existing seed is never replaced without
    checkpoint.overwrite (the rank refuses it too, with the same message), and host memory for
    the whole model in one process."""
    seed = checkpoint_folder(config) / "step-0"
    if seed.exists() and not config.checkpoint.overwrite:
        raise ConfigError(f"{seed} exists already; refusing to overwrite it (use --checkpoint.overwrite)")
    check_host_memory(config, seed_memory_need(config), meminfo)


def check(config: JobConfig, nproc: int, device_type: str, local_procs: int | None = None,
          meminfo: str | Path | None = None) -> RunPlan:
    """Every check of a training run before its processes start: layout, batch split, device
    options, host memory (of a machine running `local_procs` of the `nproc` processes), a step's
    memory on a GPU (trainer/preflight/step_bound.py), and the
    checkpoint to resume against training.steps (check_resume: RunComplete when the run is
    finished already)."""
    plan = plan_run(config, nproc)
    check_device_options(config, device_type)
    say_unused_hf_shapes(config)
    local = nproc if local_procs is None else local_procs
    check_host_memory(config, training_memory_need(config, plan.dims, device_type, local), meminfo)
    if device_type == "cuda" and not os.environ.get("TRAINER_SKIP_MEMORY_CHECK"):
        check_device_memory(config, plan.dims, gpu_memory())
    refuse_record_links(config)
    check_resume(config)  # last, as in the ranks: any other mistake is reported first
    return plan


def refuse_record_links(config: JobConfig) -> None:
    """ConfigError when a record file the run would write (run_meta.json, metrics.jsonl,
    lineage.json) is a link: the run refuses to write through it, so it is refused at the start,
    by the launcher and by a trainer started without it alike."""
    try:
        run_meta.refuse_links(Path(config.job.dump_folder))
        refuse_link(checkpoint_folder(config) / LINEAGE_FILE)
    except LinkRefused as e:
        raise ConfigError(str(e)) from None


USAGE = "usage: python -m trainer.preflight --nproc N --device cpu|cuda [--nproc-per-node K] [--section.key value ...]"


def main(argv: list[str]) -> int:
    """python -m trainer.preflight --nproc N --device cpu|cuda [--nproc-per-node K] [--section.key value ...]

    --nproc-per-node: the processes of one machine (default N), for the host memory check."""
    messages.configure()
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.strip()}\n\nThe trainer's own options: python -m trainer.train --help")
        return 0
    if (len(argv) < 4 or argv[0] != "--nproc" or not argv[1].isdigit() or int(argv[1]) < 1 or argv[2] != "--device"
            or argv[3] not in ("cpu", "cuda")):
        print(USAGE, file=sys.stderr)
        return 2
    nproc, device_type, rest = int(argv[1]), argv[3], argv[4:]
    local = None
    if rest[:1] == ["--nproc-per-node"]:
        if len(rest) < 2 or not rest[1].isdigit():
            print(USAGE, file=sys.stderr)
            return 2
        local, rest = int(rest[1]), rest[2:]
    try:
        config = load_config(with_default_config(rest))
        plan = check(config, nproc, device_type, local)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunComplete as done:  # only said: a check writes nothing into the run's folder
        print(done.message, flush=True)
        return 0
    print(describe_run(config, plan, nproc, device_type))
    print(f"outputs: {Path(config.job.dump_folder).resolve()}")
    return 0


def describe_run(config: JobConfig, plan: RunPlan, nproc: int, device_type: str) -> str:
    return (f"config: {config.job.config_file or '(defaults)'}; model {config.model.flavor}; {nproc} process{'es' if nproc != 1 else ''} "
            f"on {device_type} {describe_degrees(plan.dims)}")
