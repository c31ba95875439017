"""Save and stop on a signal (trainer/launch/stop_request.py): which step the ranks agree on, which
signals count, and when the launcher may pass a signal on to a rank."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import pytest

from trainer.launch import stop_request
from trainer.launch.stop_request import STOP_MARGIN, StopAgreement, catches


class Store:
    """The few calls of torch's key-value store the agreement makes, over a dict shared by ranks."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.values and expected == "":
            self.values[key] = desired.encode()
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


@pytest.fixture
def received(monkeypatch):
    """The signals this process noted, emptied for each test."""
    noted: set[signal.Signals] = set()
    monkeypatch.setattr(stop_request, "_received", noted)
    return noted


def two_ranks(store: Store, signal_name: str = "SIGUSR1", saves: bool = True) -> list[StopAgreement]:
    """Two ranks' agreements of one run: they share the key, as every rank's n-th Trainer does."""
    first = StopAgreement(signal_name, saves, store)
    second = StopAgreement(signal_name, saves, store)
    second.key = first.key
    return [first, second]


def test_the_first_proposal_is_the_step_every_rank_stops_at(received):
    store = Store()
    ranks = two_ranks(store)
    assert [rank.after_step(1) for rank in ranks] == [None, None]  # nobody asked: no stop
    received.add(signal.SIGUSR1)
    assert ranks[0].after_step(5) == 5 + STOP_MARGIN  # rank 0 proposes
    assert ranks[1].after_step(6) == 5 + STOP_MARGIN  # rank 1 proposes too, late: the first proposal stays
    assert ranks[0].after_step(6) == 5 + STOP_MARGIN


def test_a_rank_without_the_signal_reads_the_agreed_step(received):
    store = Store()
    ranks = two_ranks(store)
    received.add(signal.SIGUSR1)
    ranks[0].after_step(3)
    received.clear()  # as if only rank 0's process had the signal
    assert ranks[1].after_step(4) == 3 + STOP_MARGIN


def test_a_world_of_one_stops_at_once(received):
    agreement = StopAgreement("SIGUSR1", True, store=None)
    received.add(signal.SIGUSR1)
    assert agreement.after_step(7) == 7


@pytest.mark.parametrize("configured, saves, why", [
    ("SIGUSR2", True, "checkpoint.save_on_signal is SIGUSR2"),
    ("none", True, "checkpoint.save_on_signal is none"),
    ("SIGUSR1", False, "this run saves no checkpoints"),
])
def test_a_signal_that_does_not_count_is_logged_once_and_training_goes_on(received, caplog, configured, saves, why):
    store = Store()
    agreement = StopAgreement(configured, saves, store)
    received.add(signal.SIGUSR1)
    with caplog.at_level(logging.WARNING, logger="trainer.launch.stop_request"):
        assert agreement.after_step(1) is None and agreement.after_step(2) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("SIGUSR1 received and ignored: ") and why in warnings[0]
    assert store.values == {}


def test_listen_notes_both_signals_instead_of_dying(received):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        stop_request.listen()
        signal.raise_signal(signal.SIGUSR2)
        assert stop_request.received() == {signal.SIGUSR2}
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_catches_tells_a_process_that_handles_the_signal_from_one_that_would_die():
    code = ("import signal, sys, time\n"
            "if sys.argv[1] == 'listen': signal.signal(signal.SIGUSR1, lambda *a: None)\n"
            "print('ready', flush=True); time.sleep(30)\n")
    for mode, expected in (("listen", True), ("default", False)):
        proc = subprocess.Popen([sys.executable, "-c", code, mode], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "ready\n"
            assert catches(proc.pid, signal.SIGUSR1) is expected, mode
        finally:
            proc.kill()
            proc.wait()
    assert catches(2**22 + 12345, signal.SIGUSR1) is True  # no such process: cannot tell, so send


def test_a_process_whose_work_is_done_ignores_a_late_stop_request():
    """The launcher, once its ranks' result is in, ignores the stop signals at the kernel (not
    only in Python, whose shutdown would reset a handled signal to its default, death): a request
    that arrives then, as SLURM's time-limit signal can just as a run ends, leaves its exit code."""
    code = ("import os, signal\n"
            "from trainer.launch import stop_request\n"
            "stop_request.listen(); stop_request.ignore()\n"
            "status = open('/proc/self/status').read()\n"
            "ignored = int(next(l for l in status.splitlines() if l.startswith('SigIgn:')).split()[1], 16)\n"
            "assert all(ignored >> (s.value - 1) & 1 for s in (signal.SIGUSR1, signal.SIGUSR2)), hex(ignored)\n"
            "os.kill(os.getpid(), signal.SIGUSR1); os.kill(os.getpid(), signal.SIGUSR2)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
