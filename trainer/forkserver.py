"""Child processes that start from multiprocessing's fork server with the modules they need
already imported: each is forked from it in milliseconds instead of importing torch again (2-3 s
of CPU), from a clean process rather than a copy of a trainer holding communicators and device
contexts.

There is one fork server per process, started by its first user. Every user names the modules
its children need (`preloaded_context`), and the server, when it starts, imports all that were
named by then: the stream tokenizer's workers, the estimator's rank kinds and the tests' process
groups can share it. Where there is no fork server, the children are spawned."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

_preload: list[str] = []  # what every user has named, in order


def preloaded_context(modules: list[str]) -> BaseContext:
    """The multiprocessing context to start children with: the fork server, which imports
    `modules` (with those of the other users) when it starts, or spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _preload.extend(module for module in modules if module not in _preload)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_preload))  # read when the server starts; later, ignored
    return context
