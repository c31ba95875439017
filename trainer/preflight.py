"""Checks of a configuration against a world size, before any process group exists.

`python -m trainer.preflight --nproc N --device cpu|cuda [overrides]` runs them in one light process (no torch
import): the launcher calls it so a user's mistake gets one clear message instead of one
traceback per rank. The trainer repeats the same checks in every rank.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint_layout import check_load_options
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError, load_config
from trainer.parallel.dims import ParallelDims, layout_problems


@dataclass(frozen=True)
class RunPlan:
    dims: ParallelDims
    global_batch_size: int
    accumulation_steps: int


def unsupported(config: JobConfig) -> list[str]:
    """Options that are valid but whose feature this trainer does not provide yet."""
    checks = {"model.hf_assets_path": bool(config.model.hf_assets_path)}
    return [f"{name}: not implemented yet" for name, enabled in checks.items() if enabled]


def check_device_options(config: JobConfig, device_type: str) -> None:
    """Options that only make sense with accelerators."""
    if device_type == "cpu":
        if config.training.enable_cpu_offload:
            raise ConfigError("training.enable_cpu_offload: moves FSDP state from GPU to CPU memory; this run is on "
                              "the CPU already, where it has nothing to offload")
        if config.parallelism.enable_async_tensor_parallel:
            raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory)")


def check_data(config: JobConfig) -> None:
    """Cheap checks of the data options: files exist, the tokenizer loads and fits the model."""
    from trainer.data.text_sources import DataError, find_data_files
    from trainer.models.llama3.args import FLAVORS

    c = config
    text_sources = {c.training.dataset, c.validation.dataset if c.validation.enable else ""} - {"", "synthetic"}
    try:
        if text_sources and not c.model.tokenizer_path:
            raise ConfigError(f"model.tokenizer_path: dataset {sorted(text_sources)[0]!r} is text and needs a "
                              "SentencePiece model (train one: python -m trainer.data.tokenizer train --help)")
        if c.model.tokenizer_path:
            from trainer.data.tokenizer import Tokenizer, check_vocab_fits

            check_vocab_fits(Tokenizer(c.model.tokenizer_path), FLAVORS[c.model.flavor].vocab_size)
        for key, dataset, path in (("training", c.training.dataset, c.training.dataset_path),
                                   ("validation", c.validation.dataset, c.validation.dataset_path)):
            if dataset == "files":
                if not path:
                    raise ConfigError(f"{key}.dataset_path: required for dataset 'files' (a file, folder or glob)")
                find_data_files(path)
    except (DataError, ValueError) as e:
        raise ConfigError(str(e)) from None


def plan_run(config: JobConfig, world_size: int) -> RunPlan:
    """Resolve parallel degrees and the batch split; raise ConfigError naming the key to fix."""
    problems = unsupported(config)
    if problems:
        raise ConfigError("options not available in this version:\n  " + "\n  ".join(problems))
    check_data(config)
    try:
        check_load_options(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


def describe_degrees(dims: ParallelDims) -> str:
    return "(" + " ".join(f"{k}={v}" for k, v in dims.degrees().items()) + ")"


def main(argv: list[str]) -> int:
    """python -m trainer.preflight --nproc N --device cpu|cuda [--section.key value ...]"""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if len(argv) < 4 or argv[0] != "--nproc" or argv[2] != "--device" or argv[3] not in ("cpu", "cuda"):
        print("usage: python -m trainer.preflight --nproc N --device cpu|cuda [--section.key value ...]", file=sys.stderr)
        return 2
    nproc, device_type = int(argv[1]), argv[3]
    try:
        config = load_config(argv[4:])
        plan = plan_run(config, nproc)
        check_device_options(config, device_type)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    degrees = describe_degrees(plan.dims)
    print(f"config: {config.job.config_file or '(defaults)'}; model {config.model.flavor}; {nproc} processes "
          f"on {device_type} {degrees}")
    print(f"outputs: {Path(config.job.dump_folder).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
