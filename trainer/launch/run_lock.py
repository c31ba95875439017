"""One live job per dump folder and per checkpoint folder: <job.dump_folder>/.lock, and
<checkpoint folder>/.lock for a run that writes checkpoints (an absolute checkpoint.folder may
name the checkpoint folder of another dump folder).

Two jobs writing into one dump folder corrupt each other's record, metrics and checkpoints (one
resumes from a checkpoint the other is still writing, both save the same steps). Whoever starts a
run takes its locks before anything is written, and releases them when it ends: the launcher,
after its checks and before any rank starts; a trainer started without it (`python -m
trainer.train`, or torchrun directly) takes them in rank 0 (trainer.train.hold_run_locks). The
file holds its holder as JSON: {"host", "pid", "start_ticks", "started"} (start_ticks: the
process's start time in clock ticks since boot, field 22 of /proc/<pid>/stat, which tells a live
holder from a later process that got the same PID). It is never opened through a link
(trainer/records/safe_writes.py): a `.lock` that is a symbolic link is refused, its target untouched.

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

from trainer.launch.launcher_watch import LAUNCHER_PID_ENV
from trainer.records.safe_writes import LinkRefused, open_no_follow

LOCK_FILE = ".lock"


class LockRefused(Exception):
    """Another job holds the dump folder; the message names it and what to do."""


@dataclass
class RunLock:
    path: Path
    fd: int
    note: str | None = None  # what was taken over, for the console
    key: str = "job.dump_folder"  # the option that names the locked folder

    def release(self) -> None:
        """Remove the file, then drop the flock (in this order, so that nobody takes over a file
        that is about to disappear: see `take`). Releasing twice does nothing."""
        if self.fd < 0:
            return
        try:
            if same_file(self.fd, self.path):  # still ours: not removed and replaced by hand meanwhile
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1


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


def take(folder: Path, key: str = "job.dump_folder") -> RunLock:
    """The lock of `folder` (the folder option `key` names) for this process; LockRefused when a
    live job holds it, or when its lock file is a link."""
    folder = Path(folder).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LockRefused(f"{key} {folder}: cannot be created ({e.strerror}); choose a folder this user can write")
    path = folder / LOCK_FILE
    for _ in range(10):
        try:
            fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, 0o644)
        except LinkRefused as e:
            raise LockRefused(f"{key} {folder}: {e}") from None
        except OSError as e:
            raise LockRefused(f"{key} {folder}: its lock {path} cannot be written ({e.strerror}); a run needs a "
                              "folder it can write") from None
        try:
            flocked = try_flock(fd)
            holder = read_holder(fd)
            if not flocked:
                raise LockRefused(refusal(path, holder, "holds it", key))
            if same_file(fd, path):  # not a file its holder removed while we opened it
                note = judge(path, holder, key)
                write_holder(fd)
                return RunLock(path, fd, note, key)
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
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def judge(path: Path, holder: dict, key: str = "job.dump_folder") -> str | None:
    """With the flock: refuse a holder that may live; a note when a stale lock is taken over."""
    if not holder:
        return None
    if holder.get("host") != socket.gethostname():
        raise LockRefused(refusal(path, holder, "may still hold it (a process of another machine cannot be "
                                                "checked from here)", key))
    if holder_alive(holder):
        raise LockRefused(refusal(path, holder, "holds it", key))
    return f"took over the lock {path} of a job that is gone ({describe_holder(holder)})"


def refusal(path: Path, holder: dict, what: str, key: str = "job.dump_folder") -> str:
    who = describe_holder(holder) if holder else "another process"
    folder = "dump folder" if key == "job.dump_folder" else "checkpoint folder"
    return (f"{key} {path.parent}: another job ({who}) {what}, and two jobs must not write into one "
            f"{folder}; use another --{key}, or wait for that job to end. If it is known to be gone "
            f"(its machine was shut down), remove {path}")


def run_folders(dump_folder: Path, checkpoint_folder: Path | None) -> list[tuple[Path, str]]:
    """The folders a run writes that need a lock, with the option naming each: the dump folder,
    and the checkpoint folder it writes, if any. The checkpoint folder is locked even inside the
    dump folder: another job may name it as its own (an absolute checkpoint.folder)."""
    dump = Path(dump_folder).resolve()
    folders = [(dump, "job.dump_folder")]
    if checkpoint_folder is not None and Path(checkpoint_folder).resolve() != dump:
        folders.append((Path(checkpoint_folder).resolve(), "checkpoint.folder"))
    return folders


def take_all(folders: list[tuple[Path, str]]) -> list[RunLock]:
    """The lock of every folder, or none: LockRefused when one is held (those taken are released)."""
    taken: list[RunLock] = []
    try:
        for folder, key in folders:
            taken.append(take(folder, key))
    except BaseException:
        release_all(taken)
        raise
    return taken


def release_all(locks: list[RunLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def held_by(folder: Path, pid: int) -> bool:
    """Whether the lock of `folder` names process `pid` of this host as its live holder (the
    launcher that started this rank holds its run's locks)."""
    path = Path(folder).resolve() / LOCK_FILE
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        holder = read_holder(fd)
    finally:
        os.close(fd)
    return (holder.get("pid") == pid and holder.get("host") == socket.gethostname()
            and holder_alive(holder))


def write_holder(fd: int) -> None:
    pid = os.getpid()
    holder = {"host": socket.gethostname(), "pid": pid, "start_ticks": process_start_ticks(pid),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)


def folders_of(config) -> list[tuple[Path, str]]:
    """The folders a run of `config` writes and must lock (see run_folders): the checkpoint
    folder only when it writes checkpoints there (a seed checkpoint, or checkpoint.enable
    without load_only)."""
    c = config.checkpoint
    writes_checkpoints = c.create_seed_checkpoint or (c.enable and not c.load_only)
    dump = Path(config.job.dump_folder)
    return run_folders(dump, dump / c.folder if writes_checkpoints else None)


def take_unless_held(folders: list[tuple[Path, str]], launcher_pid: str | None) -> list[RunLock]:
    """A trainer's locks: none when the launcher that started it (`launcher_pid`, from the
    environment) holds every one already, else all of them (LockRefused when one is held)."""
    if launcher_pid and launcher_pid.isdigit() and all(held_by(folder, int(launcher_pid)) for folder, _ in folders):
        return []
    return take_all(folders)


def hold(config, rank: int, world_size: int, device) -> list[RunLock]:
    """The locks of the folders a trainer's run writes, taken by rank 0 unless the launcher that
    started the ranks holds them (a trainer started by `python -m trainer.train`, by torchrun
    directly, or a job of several machines, whose launchers take none). Every rank learns the
    outcome (one broadcast over the process group): a refusal stops them all with the holder's
    message, as LockRefused."""
    locks, refused = [], None
    if rank == 0:
        try:
            locks = take_unless_held(folders_of(config), os.environ.get(LAUNCHER_PID_ENV))
        except LockRefused as e:
            refused = str(e)
    if world_size > 1:
        import torch.distributed as dist  # here: this module is torch-free for the launcher

        box = [refused]
        dist.broadcast_object_list(box, src=0, device=device)
        refused = box[0]
    if refused:
        raise LockRefused(refused)
    return locks
