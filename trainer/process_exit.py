"""How a process that ran collectives ends: with its exit code and its output flushed, and without
Python's interpreter teardown. Torch-free, so that any entry point can use it."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_process(entry: Callable[[], int | None]) -> NoReturn:
    """Run a process's entry point, then end the process with its exit code without Python's
    interpreter teardown (see `exit_without_teardown`).

    What Python would do with an escaping exception is done here: SystemExit gives its code
    (a message is printed, exit 1), Ctrl-C gives 130, any other exception prints its traceback
    and gives 1.
    """
    try:
        code = entry()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 (reported like Python does, then the same exit path)
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_without_teardown(code or 0)


def exit_without_teardown(code: int) -> NoReturn:
    """Flush what this process wrote and end it now, skipping the interpreter's teardown.

    Why: a gloo worker thread drops its reference to a finished collective's tensors after the
    caller has already been told the collective is done, and dropping a tensor that Python also
    saw takes the GIL. If that thread first asks for the GIL after Python (3.11) has started
    finalizing, Python ends the thread with pthread_exit, whose unwinding through a C++
    destructor calls std::terminate: the process dies of SIGABRT ("terminate called without an
    active exception") after a run that succeeded. destroy_process_group() does not stop those
    threads: the groups live on while anything holds them (a device mesh does), and some holders
    outlive the trainer. Ending the process here, after the trainer has closed its process
    groups, files and writers, leaves no teardown for such a thread to run into.
    tests/unit/test_process_exit.py makes the race happen on purpose.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written
            pass
    os._exit(code)
