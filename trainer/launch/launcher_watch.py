"""A rank ends when its launcher dies.

torch's elastic agent starts each rank in a session of its own, so a signal to the launcher's
process group (Ctrl-C in a shell, `kill -9 -PGID`, a wrapper script killed, the out-of-memory
killer taking the launcher) does not reach the ranks. Without this, a rank whose launcher was
killed with SIGKILL trains on as an orphan and keeps writing checkpoints into a dump folder that a
restarted job is already reading.

The launcher puts its PID in TRAINER_LAUNCHER_PID; `watch_launcher()`, called first thing in the
rank, makes the rank die of SIGKILL as soon as that process is gone:

- on Linux through the kernel (prctl PR_SET_PDEATHSIG): immediate, nothing to poll;
- elsewhere through a thread that polls the parent PID every POLL_S seconds.

Torch-free and cheap: it runs before the rank's heavy imports are used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "TRAINER_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.5


def watch_launcher() -> str | None:
    """Die with the launcher named in TRAINER_LAUNCHER_PID; returns how ("kernel", "thread"), or
    None outside the launcher (no variable, or this process is not the launcher's child: then
    the variable was inherited by a process the rank started, which is not watched here)."""
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if not expected.isdigit():
        return None
    launcher = int(expected)
    how = "kernel" if parent_death_signal(signal.SIGKILL) else "thread"
    # The launcher may have died before the line above: the rank was then adopted by init (or a
    # subreaper) and the kernel will never send the signal.
    if os.getppid() != launcher:
        if launcher_alive_elsewhere(launcher):
            return None  # started by a process of the rank's own (a data worker), not by the launcher
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "thread":
        threading.Thread(target=poll_parent, args=(launcher,), name="launcher-watch", daemon=True).start()
    return how


def parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel for `sig` when this process's parent ends; False where it cannot (not Linux).

    The kernel sends it when the parent *thread* that started this process ends: the elastic
    agent starts ranks from its main thread, which lives as long as the launcher."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def launcher_alive_elsewhere(launcher: int) -> bool:
    """True when the launcher still runs though it is not this process's parent."""
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def poll_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)
