"""Writing the trainer's own small files (records, metrics lines, locks) never through a link.

A dump folder or checkpoint folder may hold files its run did not make: copied in, or placed by
someone else who can write there. A symbolic link named `run_meta.json`, `metrics.jsonl` or
`.lock` would make a plain open() write into whatever file it points at (a user's file, a file of
another run). Every writer here opens the final path component with O_NOFOLLOW and refuses a
link, or anything else that is not a regular file, with one message naming it. (The folders
above may be links: pointing `outputs/` at a scratch disk is a user's choice.)

Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class LinkRefused(OSError):
    """The trainer would have written one of its files through a symbolic link (or into
    something that is not a regular file); the message names the path."""


def refusal(path: Path, what: str = "a symbolic link") -> LinkRefused:
    return LinkRefused(f"{path} is {what}: the trainer never writes its records, metrics, locks or checkpoint "
                       "files through a link or into a special file; remove it (or move it away) and start again")


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open of `path` without following a link in its last component; LinkRefused for a link
    or for an existing special file (a FIFO, a device, a folder)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refusal(path) from None
        if e.errno == errno.EISDIR:
            raise refusal(path, "a folder") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refusal(path, "not a regular file")
    return fd


def open_append(path: str | os.PathLike, buffering: int = 1):
    """A text file opened for appending lines (metrics.jsonl), created when missing."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8", buffering=buffering)


def append_text(path: str | os.PathLike, text: str) -> None:
    with open_append(path, buffering=-1) as f:
        f.write(text)


def refuse_link(path: str | os.PathLike) -> None:
    """LinkRefused when `path` exists and is a link or a special file (a regular file or nothing
    is fine)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise refusal(path)
    if not stat.S_ISREG(mode):
        raise refusal(path, "not a regular file")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` by a file holding `text`, so that a reader sees the old or the new content
    and never half of it: written to a hidden file beside it, flushed, then renamed over it.

    Neither the hidden file nor `path` may be a link: a stale hidden file (left by a process
    killed while writing it, or placed there) is removed first, and the new one is created
    exclusively, so nothing that was at that name before is written into."""
    path = Path(path)
    refuse_link(path)  # renaming over a link would replace it silently: refuse, as for the others
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.unlink()  # a link is removed, never followed
    except FileNotFoundError:
        pass
    fd = open_no_follow(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
