"""The cores that pytest-xdist's workers share (tests/machine_share.py): one-process tests run side
by side, a test that wants the machine waits for them and then runs alone, and is not overtaken; a
worker keeps the whole machine for its next test only when that one wants the whole machine too."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.machine_share import STREAK_S, SHORT_TEST_S, CoreLocks, cores_of, in_file_order


def hold_in_thread(folder: Path, cores: int, log: list, name: str, release: threading.Event):
    """A worker of its own (its own locks on the shared folder) running one test that holds `cores`."""
    def body():
        locks = CoreLocks(folder, cores=2)
        locks.take(cores)
        log.append(f"{name} in")
        release.wait(10)
        log.append(f"{name} out")
        locks.release()
    thread = threading.Thread(target=body)
    thread.start()
    return thread


def wait_until(condition, timeout: float = 5):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_one_core_tests_share_the_machine_and_a_whole_machine_test_waits_for_them(tmp_path):
    log: list[str] = []
    first, second, whole, late = (threading.Event() for _ in range(4))
    threads = [hold_in_thread(tmp_path, 1, log, "a", first), hold_in_thread(tmp_path, 1, log, "b", second)]
    wait_until(lambda: {"a in", "b in"} <= set(log))  # two one-core tests at once
    threads.append(hold_in_thread(tmp_path, 4, log, "whole", whole))  # more than the machine: all of it
    time.sleep(0.3)
    threads.append(hold_in_thread(tmp_path, 1, log, "late", late))  # comes after the waiting whole-machine test
    time.sleep(0.3)
    assert "whole in" not in log and "late in" not in log
    first.set()
    time.sleep(0.3)
    assert "whole in" not in log and "late in" not in log  # one core is free, the whole test needs two
    second.set()
    wait_until(lambda: "whole in" in log)
    time.sleep(0.3)
    assert "late in" not in log  # the machine is the whole test's alone
    whole.set()
    wait_until(lambda: "late in" in log)
    late.set()
    for thread in threads:
        thread.join(10)
    assert log.index("whole out") < log.index("late in")


def test_the_whole_machine_is_kept_after_a_short_test_for_a_next_that_wants_it_and_a_core_never_is(tmp_path,
                                                                                                   monkeypatch):
    worker = CoreLocks(tmp_path, cores=2)
    worker.take(2)
    assert worker.keep_for(2, 0.1) and worker.keep_for(8, 0.1) and not worker.keep_for(1, 0.1)
    assert not worker.keep_for(2, SHORT_TEST_S)  # after a long test, the other worker's turn
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + STREAK_S)
    assert not worker.keep_for(2, 0.1)  # a streak of short tests ends
    monkeypatch.undo()
    log: list[str] = []
    other = threading.Event()
    waiting = hold_in_thread(tmp_path, 1, log, "other", other)  # the other worker's one-core test
    time.sleep(0.3)
    # The next whole-machine test keeps the machine: no wait at the turnstile, where the other waits.
    kept = threading.Thread(target=worker.take, args=(2,))
    kept.start()
    kept.join(2)
    assert not kept.is_alive() and len(worker.held) == 2 and "other in" not in log
    worker.take(1)  # a one-core test gives the machine back first, then takes its core
    wait_until(lambda: "other in" in log)
    assert len(worker.held) == 1 and not worker.keep_for(1, 0.1) and not worker.keep_for(2, 0.1)
    worker.release()
    other.set()
    waiting.join(10)
    assert log == ["other in", "other out"]


class FakeItem:
    def __init__(self, path: str, mark=None):
        self.path = Path(path)
        self._mark = mark

    def get_closest_marker(self, name):
        return self._mark if name == "cores" else None


@pytest.mark.parametrize("path, mark, cores", [
    ("/repo/tests/unit/test_x.py", None, 1),
    ("/repo/tests/protocol/test_x.py", None, 1),
    ("/repo/tests/integration/test_x.py", None, 1),
    ("/repo/tests/integration/test_x.py", pytest.mark.cores(2).mark, 2),
    ("/repo/tests/unit/test_x.py", pytest.mark.cores(4).mark, 4),
])
def test_the_cores_a_test_holds(path, mark, cores):
    assert cores_of(FakeItem(path, mark)) == cores


def test_files_that_hold_the_machine_come_first_then_integration_protocol_unit_by_size():
    whole = pytest.mark.cores(2).mark
    files = {  # path -> the cores marks of its tests, in collection order
        "/repo/tests/unit/test_many.py": [None] * 5,
        "/repo/tests/unit/test_few.py": [None] * 2,
        "/repo/tests/protocol/test_plan.py": [None] * 3,
        "/repo/tests/integration/test_mostly_one_core.py": [whole, None, None],
        "/repo/tests/integration/test_long.py": [None],
        "/repo/tests/protocol/test_real_plans.py": [whole, whole, None],
        "/repo/tests/slurm/test_cluster.py": [whole, None],
        "/elsewhere/test_outside.py": [None] * 9,
    }
    items = [FakeItem(path, mark) for path, marks in files.items() for mark in marks]
    for index, item in enumerate(items):
        item.index = index
    ordered = in_file_order(items, whole_machine=2, suite=Path("/repo/tests"))
    paths = list(dict.fromkeys(str(item.path) for item in ordered))
    assert paths == ["/repo/tests/slurm/test_cluster.py", "/repo/tests/protocol/test_real_plans.py",
                     "/repo/tests/integration/test_mostly_one_core.py", "/repo/tests/integration/test_long.py",
                     "/repo/tests/protocol/test_plan.py", "/repo/tests/unit/test_many.py",
                     "/repo/tests/unit/test_few.py", "/elsewhere/test_outside.py"]
    for path in paths:  # a file's tests stay together and in their order
        indexes = [item.index for item in ordered if str(item.path) == path]
        assert indexes == sorted(indexes) and indexes == list(range(indexes[0], indexes[0] + len(indexes)))
    # On a machine of 4 cores a cores(2) test holds half of it: no file holds the machine.
    assert list(dict.fromkeys(str(item.path) for item in in_file_order(items, 4, Path("/repo/tests"))))[:3] == [
        "/repo/tests/slurm/test_cluster.py", "/repo/tests/integration/test_mostly_one_core.py",
        "/repo/tests/integration/test_long.py"]
