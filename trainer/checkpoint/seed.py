"""`--checkpoint.create_seed_checkpoint`: the step-0, model-only checkpoint that fixes the initial
weights of every layout, written by ONE process (whatever the configured degrees) from the model
initialized on the CPU with debug.seed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from trainer.launch import run_lock
from trainer.checkpoint.manager import checkpoint_record, refuse_overwrite, save_seed_checkpoint
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError
from trainer.models.llama3 import Transformer
from trainer.models.llama3.hf_config import configured_model_args
from trainer.launch.launcher_watch import LAUNCHER_PID_ENV
from trainer.preflight.checks import check_seed

logger = logging.getLogger("trainer")


def create_seed_checkpoint(config: JobConfig) -> int:
    """Initialize the model on the CPU in this one process and save it as a step-0 checkpoint,
    holding the locks of the folders it writes (unless the launcher that started it does)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: runs as ONE process, but {world_size} were started; "
                          "run ./torchrun_launch.sh --checkpoint.create_seed_checkpoint (it starts one)")
    try:
        locks = run_lock.take_unless_held(run_lock.folders_of(config), os.environ.get(LAUNCHER_PID_ENV))
    except run_lock.LockRefused as e:
        raise ConfigError(str(e)) from None
    try:
        return write_seed_checkpoint(config, Path(config.job.dump_folder) / config.checkpoint.folder)
    finally:
        run_lock.release_all(locks)


def write_seed_checkpoint(config: JobConfig, folder: Path) -> int:
    refuse_overwrite(folder / "step-0", config.checkpoint.overwrite)  # before the (long) init
    check_seed(config)  # the whole model in float32 in this process: refuse before the allocator fails
    model_args = configured_model_args(config.model)
    model_args.max_seq_len = config.training.seq_len
    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=config.debug.seed, device="cpu")
    path = save_seed_checkpoint(model, folder, overwrite=config.checkpoint.overwrite,
                                record=checkpoint_record(config, 0, ["model"], "seed"))
    count = sum(p.numel() for p in model.parameters())
    logger.info("seed checkpoint of %s (%d parameters, seed %d) written to %s", config.model.flavor, count,
                config.debug.seed, path.resolve())
    logger.info("use it: --checkpoint.enable with --job.dump_folder %s, or --checkpoint.initial_load_path %s "
                "--checkpoint.load_only for runs that must not write next to it", config.job.dump_folder, path)
    return 0
