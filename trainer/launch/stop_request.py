"""Save and stop on request: a run that gets checkpoint.save_on_signal (SIGUSR1 by default) saves a
checkpoint at a step every rank agrees on and ends with exit code 75 (SAVED_AND_STOPPED), so that
a new start of the same command resumes onto the same curve.

SLURM sends such a signal before a job's time limit (`#SBATCH --signal=USR1@120`) and when a job
is preempted with a grace time; `kill -USR1 <launcher pid>` asks for the same by hand. The signal
reaches the launcher (trainer/launch/launcher.py), which passes it on to its ranks.

The ranks get the signal at different moments, so each rank that has it proposes a stop step in
the process group's key-value store and every rank reads the agreed one after each step (one small
store round trip, no device synchronization). The first proposal wins: its step is the proposer's
current step plus STOP_MARGIN. No rank can have passed that step without seeing the proposal: every
step ends with a collective over all ranks (the global gradient norm), and the host waits each
step for the norm of the step before, so a rank's host is at most one step past the slowest rank
plus the step it is in.

Torch-free at import, so that the handler is in place before torch's import takes seconds.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

SAVED_AND_STOPPED = 75  # EX_TEMPFAIL: the run is not done; start it again to resume
STOP_MARGIN = 2
SIGNAL_CHOICES = ("SIGUSR1", "SIGUSR2")  # or "none"
DEFAULT_SIGNAL = "SIGUSR1"  # checkpoint.save_on_signal's default; the protocol's sbatch scripts send it

_received: set[signal.Signals] = set()
_runs_in_process = 0  # each Trainer of a process gets its own store key (tests run several per group)


def listen() -> None:
    """Note SIGUSR1 and SIGUSR2 from now on instead of dying of them; which one asks for a stop
    is the configuration's choice (StopAgreement), known only once it is loaded."""
    for name in SIGNAL_CHOICES:
        signal.signal(signal.Signals[name], _note)


def ignore() -> None:
    """Ignore SIGUSR1 and SIGUSR2 from now on: for a process whose work is done (the launcher,
    about to exit with its ranks' result). Python's shutdown resets a signal it handles to the
    default action, which for these is death: a stop request arriving in those last moments (SLURM's
    time-limit signal just as a run ends) would turn a finished run into a killed one. An ignored
    signal stays ignored through the shutdown."""
    for name in SIGNAL_CHOICES:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


def _note(signum: int, _frame) -> None:
    _received.add(signal.Signals(signum))


def received() -> frozenset[signal.Signals]:
    """The stop signals this process got so far (the launcher passes them on to its ranks)."""
    return frozenset(_received)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: its /proc status), so that sending it
    cannot kill a rank still starting; True where that cannot be read."""
    try:
        for line in open(f"/proc/{pid}/status", encoding="ascii"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig.value - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


class StopAgreement:
    """The step at which every rank saves and stops, once any rank got the signal."""

    def __init__(self, signal_name: str, saves: bool, store=None):
        """`signal_name`: checkpoint.save_on_signal; `saves`: whether the run writes checkpoints
        (without them a stop could not be resumed, so the signal is ignored); `store`: the
        process group's store, None in a world of one without a process group."""
        global _runs_in_process
        _runs_in_process += 1
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key = f"trainer/save_and_stop/{restart}/{_runs_in_process}"
        self.signal = signal.Signals[signal_name] if signal_name in SIGNAL_CHOICES else None
        self.saves, self.store = saves, store
        self.stop_step: int | None = None
        self.proposed = False
        self.ignored: set[signal.Signals] = set()

    def asked(self) -> bool:
        """Whether this rank got the configured signal; other signals are logged once, ignored."""
        counts = self.signal if self.saves else None
        for sig in _received - self.ignored - {counts}:
            self.ignored.add(sig)
            why = ("this run saves no checkpoints (checkpoint.enable is off, or load_only), so it could not resume"
                   if sig == self.signal else f"checkpoint.save_on_signal is {self.signal.name if self.signal else 'none'}")
            logger.warning("%s received and ignored: %s; training goes on", sig.name, why)
        return counts in _received

    def after_step(self, step: int) -> int | None:
        """Call on every rank after each step: the agreed stop step, None while nobody asked."""
        asked = self.asked()
        if self.stop_step is not None or not (self.saves and self.signal):  # nothing to agree on
            return self.stop_step
        if asked and not self.proposed:
            self.proposed = True
            if self.store is None:  # a world of one
                self.stop_step = step
            else:  # the first proposal stays; compare_set answers with the value the key holds then
                self.stop_step = int(self.store.compare_set(self.key, "", str(step + STOP_MARGIN)))
        elif self.store is not None and self.store.check([self.key]):
            self.stop_step = int(self.store.get(self.key))
        if self.stop_step is not None:
            by = "received" if self.proposed else "received by another rank"
            logger.info("%s %s: every rank saves a checkpoint after step %d and stops", self.signal.name, by,
                        self.stop_step)
        return self.stop_step
