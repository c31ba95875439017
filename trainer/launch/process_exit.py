"""How a process that ran collectives ends: with its exit code and its output flushed, and without
Python's interpreter teardown; and how it reports its error to the launcher. Torch-free, so that
any entry point can use it."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from trainer.records.safe_writes import write_atomic

# The file torch's elastic agent (trainer/launch/launcher.py, torchrun) gives each process it starts for
# its error; the agent reads it back into ChildFailedError.failures (ProcessFailure).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# A rank's exit code when training diverged (a non-finite loss, gradient norm or parameter): from
# the same checkpoint, a restart would diverge the same way, so the launcher does not restart.
DIVERGED = 3
_reported = False


def report_error(message: str, exit_code: int, callstack: str | None = None) -> bool:
    """Write this process's error for the launcher, which prints it as the run's one message.

    The file has the JSON layout torch's ErrorHandler writes and ProcessFailure reads
    ({"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}), plus a "trainer"
    entry with the exit code and a precise time (torch's timestamp is in whole seconds), which
    the launcher uses to tell the rank that failed first from those that failed because of it.
    Only the first report of a process counts (an error while closing after another one must not
    replace it). Nothing happens outside an elastic agent. Returns whether the report was written
    (then the agent, not this process, shows the message).
    """
    global _reported
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or _reported:
        return False
    _reported = True
    now = time.time()
    data = {
        "message": {"message": message,
                    "extraInfo": {"py_callstack": callstack or message, "timestamp": str(int(now))}},
        "trainer": {"message": message, "exit_code": exit_code, "time": now},
    }
    try:  # whole or not at all: torch's agent fails on a half-written report (a full disk)
        write_atomic(path, json.dumps(data))
    except OSError as e:  # the launcher then falls back on the exit code and the log
        print(f"could not write the error report {path}: {e}", file=sys.stderr)
        return False
    return True


def run_process(entry: Callable[[], int | None]) -> NoReturn:
    """Run a process's entry point, then end the process with its exit code without Python's
    interpreter teardown (see `exit_without_teardown`).

    What Python would do with an escaping exception is done here: SystemExit gives its code
    (a message is printed, exit 1), Ctrl-C gives 130, any other exception prints its traceback
    and gives 1. The message or the exception (its last traceback line, with the traceback) is
    also reported to the launcher (`report_error`).
    """
    try:
        code = entry()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # noqa: BLE001 (reported like Python does, then the same exit path)
        callstack = traceback.format_exc()
        sys.stderr.write(callstack)
        report_error("".join(traceback.format_exception_only(type(e), e)).strip(), 1, callstack)
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        report_error(str(code), 1)
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
