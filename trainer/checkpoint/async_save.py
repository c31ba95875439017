"""Asynchronous DCP saves that are published the moment they are complete.

`dcp.async_save` copies the state into CPU memory ("staging"), returns, and writes the files in a
background thread while training goes on. DCP's coordinator (rank 0) writes `.metadata` last,
after it has gathered every rank's write results, so when rank 0's future completes, every rank's
part is on disk: rank 0 publishes the checkpoint right then, from the future's done-callback, not
at the next save. A crash between two saves therefore loses only the steps since the last one.

Two staging modes:
- "async": DCP's default, a fresh CPU copy of the state on every save.
- "async_with_pinned_mem": one stager kept for the whole run; it allocates the CPU copy at the
  first save and copies into the same buffers at every later save. With CUDA the buffers are
  page-locked (pinned), which makes the device-to-host copy faster; on a CPU-only machine nothing
  can be pinned, so the buffers are only reused.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.checksums import ChecksumWriter

logger = logging.getLogger(__name__)

ASYNC_MODES = ("async", "async_with_pinned_mem")


def reusable_stager():
    """A stager that keeps its CPU buffers between saves (pinned when CUDA is there), or None
    where this torch has no such stager (DCP's default staging is used then)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        logger.warning("checkpoint.async_mode = 'async_with_pinned_mem': this torch (%s) has no "
                       "torch.distributed.checkpoint.staging.DefaultStager; saving as with 'async'", torch.__version__)
        return None
    pinned = torch.cuda.is_available()
    if not pinned:
        logger.info("checkpoint.async_mode = 'async_with_pinned_mem': pinning needs CUDA; staging into "
                    "reused, unpinned CPU buffers")

    class KeptStager(DefaultStager):
        """DefaultStager whose CPU buffers outlive a save. torch 2.11's DefaultStager closes its
        StateDictStager at the end of every stage (cached buffers and copy table cleared): nothing
        would be reused, and the second save fails (KeyError: <class 'type'>). torch 2.13's keeps
        them until close(), and with the options below (synchronous, blocking copies) its stage
        is exactly this one: both releases run the same code."""

        def _stage(self, state_dict, **kwargs):
            return self._state_dict_stager.stage(state_dict, non_blocking=False)

    # Synchronous staging: the copy is complete when async_save returns, so the optimizer step
    # that follows cannot change what is saved. No shared memory: the writer is a thread.
    return KeptStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                     use_async_staging=False, use_non_blocking_copy=False))


@dataclass
class _Pending:
    future: Future
    step: int
    published: threading.Event = field(default_factory=threading.Event)
    errors: list = field(default_factory=list)


class AsyncSaver:
    """Starts asynchronous saves one at a time; `publish(step, partial)` runs on rank 0 (on the
    writer's thread) as soon as a save is complete."""

    def __init__(self, mode: str, rank: int, publish: Callable[[int, Path], None]):
        if mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode: {mode!r} is not one of {', '.join(ASYNC_MODES)}")
        self.rank, self.publish = rank, publish
        # Background saves talk over their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo")
        self.stager = reusable_stager() if mode == "async_with_pinned_mem" else None
        self.pending: _Pending | None = None

    def start(self, state: dict, step: int, partial: Path) -> None:
        """Stage `state` and write it to `partial` in the background. The caller waits for the
        previous save first (`wait`): reused staging buffers must not change while being written."""
        assert self.pending is None, "wait() for the previous save first"
        options = {"async_stager": self.stager} if self.stager is not None else {}
        future = dcp.async_save(state, storage_writer=ChecksumWriter(partial), process_group=self.group, **options)
        pending = _Pending(future, step)
        self.pending = pending
        future.add_done_callback(lambda done: self._on_done(done, pending, partial))

    def _on_done(self, future: Future, pending: _Pending, partial: Path) -> None:
        # Runs on the writer's thread (or here, if the save already finished). The main thread
        # touches the checkpoint folder only after wait(), which waits for `published`.
        try:
            if future.exception() is None and self.rank == 0:
                self.publish(pending.step, partial)
        except BaseException as e:  # a done-callback's exception would only be logged by Future
            pending.errors.append(e)
        finally:
            pending.published.set()

    def wait(self) -> None:
        """Return once the pending save is written and published; raise what failed."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.future.result()
        pending.published.wait()
        if pending.errors:
            raise pending.errors[0]
