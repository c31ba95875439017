"""Start the ranks of a process group inside a test: `start_ranks(fn, args, nprocs)` is
torch.multiprocessing's spawn (`fn(rank, *args)` in each of `nprocs` processes, joined, a rank's
exception raised here), with each rank forked from the fork server of trainer/forkserver.py, which
has imported torch once, instead of a fresh interpreter that imports it again: 2-3 s of CPU a rank.
A rank is otherwise what spawn starts: it imports the test module afresh, with the test process's
sys.path and working folder, and inherits none of its state."""

from __future__ import annotations

from typing import Callable

import torch.multiprocessing as mp

from trainer.forkserver import preloaded_context

# What the fork server imports before it forks a rank.
PRELOADED = ["torch", "torch.distributed", "pytest"]


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    method = preloaded_context(PRELOADED).get_start_method()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=method)
