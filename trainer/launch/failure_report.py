"""How a run's ranks ended, told as one message: which rank failed first (not one that failed
because of it), why, and the launcher's exit code. Used by trainer/launch/launcher.py for its final
report and by trainer/launch/elastic_agent.py for the note of each automatic restart. Torch-free."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainer.launch.stop_request import SAVED_AND_STOPPED
from trainer.preflight.checks import MemoryNeed, available_memory, gb

# How the agent stops the other ranks once one has failed (and how a scheduler or a user stops a
# run): a rank ended by one of these did not cause the failure.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
# What a rank sees when a peer died under it: a consequence, not the cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "ncclRemoteError", "remote process exited or there was a network error")
# A rank killed by a signal is noticed only at the agent's next poll, and the agent's time for it
# is in whole seconds; a signal death up to this long after the first reported error is taken as
# the cause (a rank rarely dies of a signal because a peer failed; the reverse is the rule).
SIGNAL_GRACE_S = 5.0
# How gloo and torch word a collective that waited too long for a peer.
TIMED_OUT = ("timed out", "collective operation timeout")


@dataclass
class RankFailure:
    """How one rank ended, from torch's ProcessFailure and the rank's own report."""

    rank: int
    exitcode: int  # negative: killed by signal -exitcode
    time: float  # when it failed: the report's precise time, else when the agent noticed (whole seconds)
    message: str | None = None  # the rank's report
    log_dir: Path | None = None
    killed_stopped: bool = False  # stopped (SIGSTOP), then killed by the launcher: it said nothing
    reported_exitcode: int | None = None  # the exit code the rank's report gives, None without one

    @property
    def saved_and_stopped(self) -> bool:
        """It saved a checkpoint and stopped on request (exit 75), also when the agent's SIGTERM came
        while it was exiting so: a peer that exited first ends the attempt, and the agent then stops the
        ranks still running, this one past its report."""
        return self.exitcode == SAVED_AND_STOPPED or (self.signal in STOP_SIGNALS
                                                      and self.reported_exitcode == SAVED_AND_STOPPED)

    @property
    def signal(self) -> signal.Signals | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode)
        except ValueError:
            return None

    @property
    def timed_out(self) -> bool:
        return bool(self.message) and any(text in self.message.lower() for text in TIMED_OUT)

    @property
    def peer_lost(self) -> bool:
        return bool(self.message) and any(text in self.message for text in PEER_LOST)

    @classmethod
    def from_torch(cls, rank: int, failure, folder: Path | None) -> RankFailure:
        """From a torch.distributed.elastic ProcessFailure."""
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        ours = data.get("trainer")
        message, when, reported = None, float(failure.timestamp), None
        if isinstance(ours, dict) and isinstance(ours.get("message"), str):
            message, when = ours["message"], float(ours.get("time", when))
            reported = ours.get("exit_code") if type(ours.get("exit_code")) is int else None
        elif isinstance(failure.message, dict):  # written by torch's @record / ErrorHandler
            message = str(failure.message.get("message", "")) or None
        elif data.get("message") not in (None, "<NONE>"):  # an error file with a plain message
            message = str(failure.message) or None
        log_dir = folder / f"rank{rank}" if folder is not None else None
        return cls(rank=rank, exitcode=failure.exitcode, time=when, message=message, log_dir=log_dir,
                   reported_exitcode=reported)


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The rank that failed first, not one that failed because of it: a rank stopped by the
    agent's SIGTERM, one that lost its connection to a dead peer, or a stopped rank the launcher
    killed after a peer had failed (it reports nothing; the report names it) is a consequence. Among the
    others, a rank killed by a signal (noticed late, see SIGNAL_GRACE_S) comes first, then the
    earliest report."""
    earliest = min(f.time for f in failures)

    def rank_of(f: RankFailure) -> tuple:
        if f.signal in STOP_SIGNALS or f.killed_stopped:
            tier = 3
        elif f.peer_lost:
            tier = 2
        elif f.signal is not None and f.time <= earliest + SIGNAL_GRACE_S:
            tier = 0
        else:
            tier = 1
        return tier, f.time, f.rank

    return min(failures, key=rank_of)


SIGNAL_CAUSES = {
    signal.SIGKILL: "most likely the kernel's out-of-memory killer (`dmesg | grep -i -e oom -e killed` or "
                    "`journalctl -k` says so); else a `kill -9` from a user or a scheduler",
    signal.SIGSEGV: "a crash in native code (torch, a communication library, a driver)",
    signal.SIGBUS: "a crash in native code (often a full /dev/shm or a truncated memory-mapped file)",
    signal.SIGABRT: "an abort in native code (a failed check in torch, a communication library or a driver)",
    signal.SIGILL: "a crash in native code (an instruction this CPU does not have)",
    signal.SIGFPE: "a crash in native code (an arithmetic fault)",
}
NATIVE_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


def describe(failure: RankFailure, memory: str | None = None, hang: Hang | None = None) -> tuple[str, int]:
    """(the message, the launcher's exit code) for the rank that failed first. `memory` says
    what the run needs of host memory, for a kill by the out-of-memory killer; `hang` what is
    known of a collective that timed out."""
    text, code = describe_exit(failure, memory)
    if hang is not None and failure.timed_out:
        text += "\n" + hang.explain()
    return text, code


@dataclass
class Hang:
    """What the launcher knows when a rank reports a collective that timed out: the timeouts, and
    the ranks it found stopped (SIGSTOP, a debugger) at that moment. A stopped rank never reports
    anything itself; the launcher kills it when it stops the others."""

    train_timeout_s: float
    init_timeout_s: float
    stopped: list[int] = field(default_factory=list)

    def explain(self) -> str:
        text = (f"(a peer did not join a collective within the timeout: comm.train_timeout_seconds = "
                f"{self.train_timeout_s:g} s, comm.init_timeout_seconds = {self.init_timeout_s:g} s until the "
                "first step is done")
        if self.stopped:
            ranks = ", ".join(str(r) for r in self.stopped)
            text += (f"; rank {ranks} had stopped answering: {'it was' if len(self.stopped) == 1 else 'they were'} "
                     "stopped (SIGSTOP or a debugger) and killed by the launcher")
        return text + ")"


def short_reason(failure: RankFailure) -> str:
    """How a rank ended, in a few words: `killed by SIGKILL`, `exit 1: RuntimeError: ...`."""
    if failure.signal is not None:
        return f"killed by {failure.signal.name}"
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    if failure.message:
        first = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
        return f"exit {failure.exitcode}: {first[:300]}"
    return f"exit {failure.exitcode}"


def describe_exit(failure: RankFailure, memory: str | None = None) -> tuple[str, int]:
    who = f"rank {failure.rank}"
    sig = failure.signal
    if sig is not None:
        cause = SIGNAL_CAUSES.get(sig, "sent from outside the run (kill, a scheduler's time limit, a shutdown)")
        text = f"{who} was killed by {sig.name} (signal {sig.value}): {cause}"
        if sig == signal.SIGKILL and memory:
            text += f"; {memory}"
        if sig in NATIVE_CRASHES and failure.log_dir is not None:
            text += f"; the Python stack of every thread at the crash is at the end of {failure.log_dir / 'stderr.log'}"
            stack = crash_stack(failure.log_dir / "stderr.log")
            if stack:
                text += "\nwhere it crashed (most recent call first):\n" + "\n".join(stack)
        return text, 128 + sig.value
    if failure.exitcode < 0:  # a signal number this platform does not name
        return f"{who} was killed by signal {-failure.exitcode}", 128 - failure.exitcode
    code = failure.exitcode
    if failure.message:
        text = f"{who} (exit {code}): {failure.message}"
        if failure.peer_lost:
            text += ("\n(this rank lost its connection to another one, which failed first without a report: see the "
                     "logs of the other ranks, and of the other machines in a multi-machine run)")
        return text, 2 if code == 2 else code
    last = last_line(failure.log_dir / "stderr.log") if failure.log_dir is not None else None
    text = f"{who} exited with code {code} without reporting an error"
    if last:
        text += f"; the last line of its stderr: {last}"
    return text, code


def tail_lines(path: Path, size: int = 8192) -> list[str] | None:
    """The lines of the last `size` bytes of a file, stripped, or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return [line.strip() for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None


def last_line(path: Path) -> str | None:
    lines = [line for line in tail_lines(path) or [] if line]
    return lines[-1] if lines else None


def crash_stack(path: Path, frames: int = 8) -> list[str]:
    """The innermost frames of the crashing thread in the stack dump Python's faulthandler wrote
    at the end of a rank's stderr (its 'Current thread ...' block), so that the report of a
    native crash says where it happened even where only the console is kept (CI, a scheduler)."""
    lines = tail_lines(path, 65536) or []
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if not starts:
        return []
    block = []
    for line in lines[starts[-1] + 1:]:
        if not line.startswith("File "):
            break
        block.append(f"  {line}")
    return block[:frames]


def print_block(message: str, folder: Path | None) -> None:
    """The one failure report: `error: ...` (maybe several lines), then `full logs: <folder>`."""
    sys.stdout.flush()
    block = f"error: {message}\n"
    if folder is not None:
        block += f"full logs: {folder}\n"
    sys.stderr.write(block)
    sys.stderr.flush()


def memory_note(need: MemoryNeed | None, meminfo: str | None = None) -> str | None:
    """What the run needs of host memory at least, for a rank killed by the out-of-memory killer."""
    if need is None:
        return None
    available = available_memory(meminfo)
    note = f"this run needs at least {gb(need.bytes)} of host memory"
    if available is not None:
        note += f" ({gb(available)} were available when it started)"
    return f"{note}: {need.what}"
