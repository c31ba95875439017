"""Start the ranks of a process group inside a test: `start_ranks(fn, args, nprocs)` is
torch.multiprocessing's spawn (`fn(rank, *args)` in each of `nprocs` processes, joined, a rank's
exception raised here), with each rank forked from a server process that has imported torch once
(multiprocessing's forkserver, one per test process) instead of a fresh interpreter that imports it
again: 2-3 s of CPU a rank. A rank is otherwise what spawn starts: it imports the test module
afresh, with the test process's sys.path and working folder, and inherits none of its state."""

from __future__ import annotations

import multiprocessing
from typing import Callable

import torch.multiprocessing as mp

# What the forkserver imports before it forks a rank.
PRELOADED = ["torch", "torch.distributed", "pytest"]


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOADED)  # read at the server's start
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
