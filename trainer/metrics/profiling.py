"""The [profiling] section: torch.profiler traces and CUDA memory snapshots of training steps.

`StepProfiler` wraps the training loop (`with StepProfiler(...) as profiler:`), which calls
`profiler.step(step)` once after each training step. Step numbers are the trainer's, so the
recorded windows end at steps profile_freq, 2 x profile_freq, ... also after a resume.

Outputs, per rank r, under job.dump_folder:

* <save_traces_folder>/iteration_<step>/rank<r>_trace.json: Chrome-trace JSON of the
  profiler_active steps ending at <step> (each window preceded by profiler_warmup unrecorded steps);
* <save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle: the CUDA
  allocator's history up to <step>, for https://pytorch.org/memory_viz; and
  iteration_<step>_exit/... for the step that ran out of memory.

A window that the end of training (or an error) cuts short writes no trace: every trace covers
the steps its name promises.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from trainer.config.observability import Profiling

logger = logging.getLogger(__name__)

# Allocator events kept in the memory history (older ones are dropped): a bound on the host
# memory the history holds, as each event keeps its stack trace.
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """Traces and memory snapshots of one rank; does nothing when both are off."""

    def __init__(self, config: Profiling, dump_folder: str | Path, rank: int, device: torch.device,
                 last_step: int = 0):
        """`last_step`: the step the run starts after (0, or the step it resumes from)."""
        self.config, self.rank, self.device = config, rank, device
        self.traces = Path(dump_folder) / config.save_traces_folder
        self.snapshots = Path(dump_folder) / config.save_memory_snapshot_folder
        self.last_step = last_step
        self._profiler: torch.profiler.profile | None = None
        self._running = ExitStack()
        self._stopping = False

    def __enter__(self) -> StepProfiler:
        if self.config.enable_profiling:
            self._profiler = self._running.enter_context(self._make_profiler())
        if self.config.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._running.callback(torch.cuda.memory._record_memory_history, enabled=None)
        return self

    def _make_profiler(self) -> torch.profiler.profile:
        c = self.config
        cycle = torch.profiler.schedule(wait=c.profile_freq - c.profiler_warmup - c.profiler_active,
                                        warmup=c.profiler_warmup, active=c.profiler_active)
        first = self.last_step + 1
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # The profiler counts its own steps from 0; shifting them by the first step makes the
        # cycle's index the trainer's step - 1, so windows end at multiples of profile_freq.
        return torch.profiler.profile(activities=activities, schedule=lambda i: cycle(i + first - 1),
                                      on_trace_ready=self._write_trace, record_shapes=True)

    def step(self, step: int) -> None:
        """Call once after each training step `step`."""
        self.last_step = step
        if self._profiler is not None:
            with warnings.catch_warnings():  # torch warns that a new window drops the last one's events: wanted
                warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
                self._profiler.step()
        if self.config.enable_memory_snapshot and step % self.config.profile_freq == 0:
            self._write_snapshot(f"iteration_{step}")

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        if self._stopping:  # a window cut short by the end of the loop
            return
        path = self.traces / f"iteration_{self.last_step}" / f"rank{self.rank}_trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        logger.info("profiling: trace of step %d written to %s", self.last_step, path)

    def _write_snapshot(self, name: str) -> None:
        path = self.snapshots / name / f"rank{self.rank}_memory_snapshot.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info("profiling: memory snapshot written to %s", path)

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._stopping = True
        if self.config.enable_memory_snapshot and exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
            # The history up to the failing allocation of the step that ran out: what filled the memory.
            self._write_snapshot(f"iteration_{self.last_step + 1}_exit")
        self._running.close()  # stops the memory history, then the profiler
        self._profiler = None
