"""The [training.dataloader] and [validation.dataloader] tables: worker processes that compute the
coming batches' rows ahead of the training loop (torchtitan's keys, with torch DataLoader's
meanings).

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.config.ranges import valid


@dataclass
class DataLoader:
    """Worker processes that read the coming batches ahead (files, shards and the built-in
    sources; a streamed dataset reads in training.stream_workers). The rows, their order and an
    exact resume are the same with any number of workers."""

    num_workers: int = valid(0, ge=0)
    """Processes computing the rows of the coming batches, one batch each in turn. 0: the
    training process reads each batch when it needs it."""

    persistent_workers: bool = False
    """Keep the workers alive between passes over the validation batches (it has no effect on
    training, whose batches never start over). Needs num_workers > 0."""

    pin_memory: bool = False
    """Workers' batches in page-locked memory (CUDA: the copy to the device starts at once)."""

    prefetch_factor: Optional[int] = valid(None, ge=1)
    """Batches each worker keeps ready. Unset: 2 with workers. Needs num_workers > 0."""
