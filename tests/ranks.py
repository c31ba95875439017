"""Start the ranks of a process group inside a test: `start_ranks(fn, args, nprocs)` is
torch.multiprocessing's spawn (`fn(rank, *args)` in each of `nprocs` processes, joined, a rank's
exception raised here), with each rank forked from the fork server of trainer/forkserver.py, which
has imported torch once, instead of a fresh interpreter that imports it again: 2-3 s of CPU a rank.
A rank is otherwise what spawn starts: it imports the test module afresh, with the test process's
sys.path and working folder, and inherits none of its state."""

from __future__ import annotations

from typing import Callable

import torch.multiprocessing as mp

from trainer.data.stream_lanes import WORKER_MODULES
from trainer.estimate.job import PRELOADED as ESTIMATE_MODULES
from trainer.forkserver import preloaded_context

# What the fork server imports before it forks a rank.
PRELOADED = ["torch", "torch.distributed", "pytest"]
# What every user of a test process's one fork server needs: its ranks here, the estimator's rank
# kinds, the stream tokenizer's workers, and torch's compiler front end (imported by the first
# call of any function torch keeps out of compiling). The server imports what was named when it
# starts: named by the first user alone, the others' children each imported their modules again
# (about 60 s of CPU over the suite, in the estimator's children most).
EVERY_USER = [*PRELOADED, *ESTIMATE_MODULES, *WORKER_MODULES, "torch._dynamo"]


def name_every_user() -> None:
    """Before the fork server starts (at the first child), name what all its users need."""
    preloaded_context(EVERY_USER)


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    method = preloaded_context(PRELOADED).get_start_method()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=method)
