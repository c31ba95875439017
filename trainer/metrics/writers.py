"""Where trainer.metrics.step_log sends its scalars besides the console and metrics.jsonl: TensorBoard and
Weights & Biases. Both get the same tags at the same steps (MetricsLogger builds them once)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

# The W&B project when WANDB_PROJECT is not set: the name of this distribution.
DEFAULT_WANDB_PROJECT = "llama-pretrain"


class ScalarWriter(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` (tag -> value) at training step `step`; visible to readers right away."""

    def close(self, failed: bool = False) -> None:
        """Flush and release; `failed`: the run ends with an error."""


class TensorBoardWriter:
    """Event files in `folder`; `purge_step` hides events at and after it (steps trained again)."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)
        logger.info("TensorBoard events go to %s", folder)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class WandbWriter:
    """One W&B run, its local files under `dump_folder`/wandb (with WANDB_MODE=offline, the only copy).

    `config`: the run's resolved configuration, shown as the W&B run config. `name` and `group`:
    None lets W&B (or WANDB_NAME, WANDB_RUN_GROUP) choose."""

    def __init__(self, dump_folder: Path, config: dict, name: str | None = None, group: str | None = None):
        import wandb

        from trainer.config.manager import ConfigError

        dump_folder.mkdir(parents=True, exist_ok=True)
        project = os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT
        try:
            self._run = wandb.init(project=project, dir=str(dump_folder), config=config, name=name, group=group)
        except wandb.errors.Error as e:  # no API key, no network, a bad WANDB_* variable
            raise ConfigError(f"metrics.enable_wandb: W&B could not start a run ({e}); log in with `wandb login`, "
                              f"or set WANDB_MODE=offline to write it under {dump_folder / 'wandb'} and upload it "
                              "later with `wandb sync`, or turn metrics.enable_wandb off") from None
        logger.info("W&B run %s (project %s) files go to %s", self._run.id, project, self._run.dir)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self._run.finish(exit_code=1 if failed else 0)
        # wandb stops its service process in an exit hook, which trainer processes skip
        # (trainer.launch.process_exit); stopping it here also waits until the run's files are complete.
        wandb.teardown()
