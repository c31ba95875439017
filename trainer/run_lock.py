"""One live job per dump folder: <job.dump_folder>/.lock.

Two jobs writing into one dump folder corrupt each other's record, metrics and checkpoints (one
resumes from a checkpoint the other is still writing, both save the same steps). The launcher
takes the lock after its checks, before any rank starts, and releases it when it ends; the file
holds its holder as JSON: {"host", "pid", "start_ticks", "started"} (start_ticks: the process's
start time in clock ticks since boot, field 22 of /proc/<pid>/stat, which tells a live holder from
a later process that got the same PID).

Who holds the lock is decided in this order:

1. The holder keeps an exclusive flock() on the file while it lives; the kernel drops it when the
   holder dies, however it dies (SIGKILL included). A held flock: refused.
2. A free flock on a file that names a process of this host: refused while that process (same PID,
   same start time) still runs (a filesystem without flock support); else the lock is stale and
   is taken over, with a note.
3. A free flock on a file that names another host: refused. Whether a flock of another machine is
   seen depends on the shared filesystem (NFSv4 yes, some mounts no), and that host's processes
   cannot be checked from here; the message says how to remove the file once that job is known
   to be gone.

Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".lock"


class LockRefused(Exception):
    """Another job holds the dump folder; the message names it and what to do."""


@dataclass
class RunLock:
    path: Path
    fd: int
    note: str | None = None  # what was taken over, for the console

    def release(self) -> None:
        """Remove the file, then drop the flock (in this order, so that nobody takes over a file
        that is about to disappear: see `take`)."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None when it does not run or /proc is not
    there (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def holder_alive(holder: dict) -> bool:
    """Whether the process a lock of this host names still runs (the same process, not a later
    one with its PID)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    ticks = process_start_ticks(pid)
    if ticks is not None:
        return ticks == holder.get("start_ticks")
    try:  # no /proc: the PID alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(holder: dict) -> str:
    return f"PID {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"


def take(folder: Path) -> RunLock:
    """The lock of dump folder `folder` for this process; LockRefused when a live job holds it."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = try_flock(fd)
            holder = read_holder(fd)
            if not flocked:
                raise LockRefused(refusal(path, holder, "holds it"))
            if same_file(fd, path):  # not a file its holder removed while we opened it
                note = judge(path, holder)
                write_holder(fd)
                return RunLock(path, fd, note)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise LockRefused(f"{path}: could not be taken (removed and created again while trying); try again")


def try_flock(fd: int) -> bool:
    """An exclusive flock on fd: False when another process holds one; True also where the
    filesystem has no flock (then only the file's content decides)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return True
    return True


def read_holder(fd: int) -> dict:
    data = os.pread(fd, 65536, 0)
    try:
        holder = json.loads(data) if data.strip() else {}
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def judge(path: Path, holder: dict) -> str | None:
    """With the flock: refuse a holder that may live; a note when a stale lock is taken over."""
    if not holder:
        return None
    if holder.get("host") != socket.gethostname():
        raise LockRefused(refusal(path, holder, "may still hold it (a process of another machine cannot be "
                                                "checked from here)"))
    if holder_alive(holder):
        raise LockRefused(refusal(path, holder, "holds it"))
    return f"took over the lock {path} of a job that is gone ({describe_holder(holder)})"


def refusal(path: Path, holder: dict, what: str) -> str:
    who = describe_holder(holder) if holder else "another process"
    return (f"job.dump_folder {path.parent}: another job ({who}) {what}, and two jobs must not write into one "
            f"dump folder; use another --job.dump_folder, or wait for that job to end. If it is known to be gone "
            f"(its machine was shut down), remove {path}")


def write_holder(fd: int) -> None:
    pid = os.getpid()
    holder = {"host": socket.gethostname(), "pid": pid, "start_ticks": process_start_ticks(pid),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
