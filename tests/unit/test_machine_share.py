"""The slots that pytest-xdist's workers share (tests/machine_share.py): one-slot tests run side by
side and beside a big test; a big test waits for its slots and is not overtaken, and waits for
another big test without holding up the one-slot tests; a test marked `alone` has the machine to
itself; a worker keeps its slots for its next test only when that one is big and wants as many; the
files of big tests form one chain, handed to one worker, the files of `alone` tests at its start."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import machine_share
from tests.machine_share import (SECONDS_KEY, SHORT_TEST_S, STREAK_S, WHOLE_MACHINE_CHAIN, SlotLocks, in_chain,
                                 in_file_order, machine_busy_seconds, machine_slots, machine_use, slots_of, work_unit)


def hold_in_thread(folder: Path, slots: int, log: list, name: str, release: threading.Event):
    """A worker of its own (its own locks on the shared folder, of 3 slots) running one test that
    holds `slots`."""
    def body():
        locks = SlotLocks(folder, slots=3)
        locks.take(slots)
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


def test_a_big_test_waits_for_its_slots_is_not_overtaken_and_then_runs_beside_a_one_slot_test(tmp_path):
    log: list[str] = []
    a, b, c, big, late = (threading.Event() for _ in range(5))
    threads = [hold_in_thread(tmp_path, 1, log, name, event) for name, event in (("a", a), ("b", b), ("c", c))]
    wait_until(lambda: {"a in", "b in", "c in"} <= set(log))  # three one-slot tests at once
    threads.append(hold_in_thread(tmp_path, 2, log, "big", big))
    time.sleep(0.3)
    threads.append(hold_in_thread(tmp_path, 1, log, "late", late))  # comes after the waiting big test
    time.sleep(0.3)
    a.set()
    time.sleep(0.3)
    assert "big in" not in log and "late in" not in log  # one slot is free, the big test needs two
    b.set()
    wait_until(lambda: "big in" in log)
    time.sleep(0.3)
    assert "late in" not in log  # c and the big test hold the three slots
    c.set()
    wait_until(lambda: "late in" in log)  # beside the big test
    assert "big out" not in log
    big.set()
    late.set()
    for thread in threads:
        thread.join(10)


def test_a_big_test_waiting_for_another_holds_up_no_one_slot_test_and_alone_is_alone(tmp_path):
    log: list[str] = []
    first, second, one, alone, beside, late = (threading.Event() for _ in range(6))
    threads = [hold_in_thread(tmp_path, 2, log, "first", first)]
    wait_until(lambda: "first in" in log)
    threads.append(hold_in_thread(tmp_path, 2, log, "second", second))  # waits for the big lock
    time.sleep(0.3)
    threads.append(hold_in_thread(tmp_path, 1, log, "one", one))
    wait_until(lambda: "one in" in log)  # the third slot is used meanwhile
    assert "second in" not in log
    first.set()
    one.set()
    wait_until(lambda: "second in" in log)
    threads.append(hold_in_thread(tmp_path, 3, log, "alone", alone))  # every slot: waits for the big lock
    time.sleep(0.3)
    threads.append(hold_in_thread(tmp_path, 1, log, "beside", beside))
    wait_until(lambda: "beside in" in log)  # beside the big test, as the alone one waits for that
    second.set()
    time.sleep(0.3)
    threads.append(hold_in_thread(tmp_path, 1, log, "late", late))  # comes after the alone test's turn
    time.sleep(0.3)
    assert "alone in" not in log and "late in" not in log  # it waits for `beside`, and is not overtaken
    beside.set()
    wait_until(lambda: "alone in" in log)
    time.sleep(0.3)
    assert "late in" not in log  # nothing beside it
    alone.set()
    wait_until(lambda: "late in" in log)
    late.set()
    for thread in threads:
        thread.join(10)


def test_a_worker_keeps_its_slots_after_a_short_big_test_for_a_next_as_big_and_one_slot_never(tmp_path, monkeypatch):
    worker = SlotLocks(tmp_path, slots=3)
    worker.take(2)
    assert worker.keep_for(2, 0.1) and not worker.keep_for(1, 0.1) and not worker.keep_for(3, 0.1)
    assert not worker.keep_for(2, SHORT_TEST_S)  # after a long test, the others' turn
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + STREAK_S)
    assert not worker.keep_for(2, 0.1)  # a streak of short tests ends
    monkeypatch.undo()
    log: list[str] = []
    other = threading.Event()
    waiting = hold_in_thread(tmp_path, 2, log, "other", other)  # another worker's big test
    time.sleep(0.3)
    # The next big test keeps the slots and the big lock: no wait, where the other waits.
    kept = threading.Thread(target=worker.take, args=(2,))
    kept.start()
    kept.join(2)
    assert not kept.is_alive() and len(worker.held) == 2 and "other in" not in log
    worker.take(1)  # a one-slot test gives the big test's slots back first, then takes its slot
    wait_until(lambda: "other in" in log)
    assert len(worker.held) == 1 and worker.big is None and not worker.keep_for(1, 0.1)
    worker.release()
    other.set()
    waiting.join(10)
    assert log == ["other in", "other out"]


def test_an_alone_test_after_an_alone_test_keeps_every_slot_however_long_they_ran(tmp_path, monkeypatch):
    """Two deadline tests in a row: the second starts at once, where giving the slots back would
    let the others start tests it must then wait for (a drain)."""
    worker = SlotLocks(tmp_path, slots=3)
    worker.take(3)
    assert worker.keep_for(3, 10 * SHORT_TEST_S, both_alone=True)
    # Big tests that hold every slot but are not `alone` (cores(2) with TEST_SLOTS=2): after a long one, released.
    assert not worker.keep_for(3, 10 * SHORT_TEST_S)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + STREAK_S)
    assert worker.keep_for(3, 0.1, both_alone=True)  # past STREAK_S too: the others would only delay the next
    assert not worker.keep_for(3, 0.1)  # where a streak of other big tests ends
    monkeypatch.undo()
    worker.release()


class FakeItem:
    def __init__(self, path: str, mark=None, name: str = "test"):
        self.path = Path(path)
        self.nodeid = f"{path}::{name}"
        self._mark = mark
        self.stash = pytest.Stash()

    def get_closest_marker(self, name):
        return self._mark if self._mark is not None and self._mark.name == name else None


@pytest.mark.parametrize("mark, cores, slots, held", [
    (None, 2, 3, 1),
    (pytest.mark.cores(2).mark, 2, 3, 2),
    (pytest.mark.cores(4).mark, 2, 3, 2),  # more than the machine's cores: all its cores, not every slot
    (pytest.mark.cores(4).mark, 8, 12, 4),
    (pytest.mark.alone.mark, 2, 3, 3),
    (pytest.mark.alone.mark, 8, 12, 12),
])
def test_the_slots_a_test_holds(mark, cores, slots, held):
    assert slots_of(FakeItem("/repo/tests/unit/test_x.py", mark), cores, slots) == held


@pytest.mark.parametrize("cores, slots", [("1", 2), ("2", 3), ("4", 6), ("16", 24)])
def test_the_machine_has_one_and_a_half_slots_a_core_unless_told(monkeypatch, cores, slots):
    monkeypatch.delenv("TEST_SLOTS", raising=False)
    monkeypatch.setenv("TEST_CORES", cores)
    assert machine_slots() == slots
    monkeypatch.setenv("TEST_SLOTS", "2")
    assert machine_slots() == 2
    for wrong in ("0", "two", "1.5"):
        monkeypatch.setenv("TEST_SLOTS", wrong)
        with pytest.raises(pytest.UsageError, match=f"TEST_SLOTS='{wrong}': must be a whole number of at least 1"):
            machine_slots()


def test_the_files_of_big_tests_come_first_as_one_chain_then_integration_protocol_unit_by_size():
    big = pytest.mark.cores(2).mark
    files = {  # path -> the marks of its tests, in collection order
        "/repo/tests/unit/test_many.py": [None] * 5,
        "/repo/tests/unit/test_few.py": [None] * 2,
        "/repo/tests/protocol/test_plan.py": [None] * 3,
        "/repo/tests/integration/test_mostly_one_slot.py": [big, None, None],
        "/repo/tests/integration/test_long.py": [None],
        "/repo/tests/integration/test_matrix.py": [big, big, big, big],
        "/repo/tests/integration/test_deadlines.py": [pytest.mark.alone.mark],
        "/repo/tests/protocol/test_real_plans.py": [big, big, None],
        "/repo/tests/slurm/test_cluster.py": [big, None, None, pytest.mark.chain.mark],  # one big test of 4, marked
        "/elsewhere/test_outside.py": [None] * 9,
    }
    items = [FakeItem(path, mark) for path, marks in files.items() for mark in marks]
    for index, item in enumerate(items):
        item.index = index
    ordered = in_file_order(items, lambda item: slots_of(item, 2, 3), 3, Path("/repo/tests"))
    paths = list(dict.fromkeys(str(item.path) for item in ordered))
    # The files of `alone` tests first (one drain for all of them), then by folder and size.
    chain = ["/repo/tests/integration/test_deadlines.py", "/repo/tests/integration/test_matrix.py",
             "/repo/tests/slurm/test_cluster.py", "/repo/tests/protocol/test_real_plans.py"]
    assert paths == [*chain, "/repo/tests/integration/test_mostly_one_slot.py", "/repo/tests/integration/test_long.py",
                     "/repo/tests/protocol/test_plan.py", "/repo/tests/unit/test_many.py",
                     "/repo/tests/unit/test_few.py", "/elsewhere/test_outside.py"]
    assert {str(item.path) for item in ordered if in_chain(item)} == set(chain)
    for path in paths:  # a file's tests stay together and in their order
        indexes = [item.index for item in ordered if str(item.path) == path]
        assert indexes == sorted(indexes) and indexes == list(range(indexes[0], indexes[0] + len(indexes)))
    # With 2 slots on 2 cores (TEST_SLOTS=2) a cores(2) test holds every slot too: the `alone` file is still first.
    ordered = in_file_order(items, lambda item: slots_of(item, 2, 2), 2, Path("/repo/tests"))
    assert str(ordered[0].path) == "/repo/tests/integration/test_deadlines.py"
    # On a machine of 4 cores (6 slots) a cores(2) test holds a third of it: only `alone` chains.
    ordered = in_file_order(items, lambda item: slots_of(item, 4, 6), 6, Path("/repo/tests"))
    assert {str(item.path) for item in ordered if in_chain(item)} == {"/repo/tests/integration/test_deadlines.py"}


def test_with_the_seconds_of_a_last_run_the_files_outside_the_chain_go_longest_first():
    big = pytest.mark.cores(2).mark
    files = {  # path -> [(mark, the seconds its test last took, None: not known)]
        "/repo/tests/integration/test_matrix.py": [(big, 1.0), (big, 1.0)],
        "/repo/tests/slurm/test_cluster.py": [(big, 90.0)],
        "/repo/tests/integration/test_launches.py": [(None, 3.0), (None, 4.0)],
        "/repo/tests/protocol/test_plans.py": [(None, 2.0)] * 3,
        "/repo/tests/unit/test_compiled_kernel.py": [(None, 20.0), (None, None)],
        "/repo/tests/unit/test_new.py": [(None, None)] * 4,
        "/repo/tests/integration/test_new_too.py": [(None, None)],
    }
    items, seconds = [], {}
    for path, tests in files.items():
        for index, (mark, last) in enumerate(tests):
            items.append(FakeItem(path, mark, f"test_{index}"))
            if last is not None:
                seconds[items[-1].nodeid] = last
    ordered = in_file_order(items, lambda item: slots_of(item, 2, 3), 3, Path("/repo/tests"), seconds)
    paths = list(dict.fromkeys(str(item.path) for item in ordered))
    # The chain first, in its folder order whatever its seconds; then 20, 7 and 6 s; then the
    # files without seconds, by folder and size.
    assert paths == ["/repo/tests/integration/test_matrix.py", "/repo/tests/slurm/test_cluster.py",
                     "/repo/tests/unit/test_compiled_kernel.py", "/repo/tests/integration/test_launches.py",
                     "/repo/tests/protocol/test_plans.py", "/repo/tests/integration/test_new_too.py",
                     "/repo/tests/unit/test_new.py"]
    # Without them, the order of a fresh checkout.
    ordered = in_file_order(items, lambda item: slots_of(item, 2, 3), 3, Path("/repo/tests"))
    assert list(dict.fromkeys(str(item.path) for item in ordered))[2:] == [
        "/repo/tests/integration/test_launches.py", "/repo/tests/integration/test_new_too.py",
        "/repo/tests/protocol/test_plans.py", "/repo/tests/unit/test_new.py", "/repo/tests/unit/test_compiled_kernel.py"]


class FakeCache(dict):
    def set(self, key, value):
        self[key] = value


def test_a_run_adds_its_tests_seconds_to_pytests_cache(tmp_path, monkeypatch):
    """Setup, call and teardown summed; the seconds of tests this run did not run are kept (the fast
    tier runs some of a file's tests), those of files that are gone dropped; a worker writes nothing."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    cache = FakeCache({SECONDS_KEY: {"tests/test_a.py::test_kept": 5.0, "tests/test_a.py::test_run": 1.0,
                                     "tests/test_gone.py::test_x": 3.0}})
    monkeypatch.setattr(machine_share, "_seconds_this_run", {})
    for duration in (0.5, 2.0, 0.25):
        machine_share.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/test_a.py::test_run", duration=duration))
    worker = SimpleNamespace(config=SimpleNamespace(cache=cache, rootpath=tmp_path, workerinput={}))
    machine_share.pytest_sessionfinish(worker)
    assert cache[SECONDS_KEY]["tests/test_a.py::test_run"] == 1.0
    machine_share.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace(cache=cache, rootpath=tmp_path)))
    assert cache[SECONDS_KEY] == {"tests/test_a.py::test_kept": 5.0, "tests/test_a.py::test_run": 2.75}


@pytest.mark.parametrize("stored, read", [
    ({"t.py::a": 1.5, "t.py::b": 2}, {"t.py::a": 1.5, "t.py::b": 2.0}),
    ({"t.py::a": 1.5, "t.py::b": "long", "t.py::c": None, "t.py::d": True}, {"t.py::a": 1.5}),
    (["t.py::a", 1.5], {}),
    ("damaged", {}),
])
def test_a_damaged_or_foreign_table_of_seconds_counts_as_none(stored, read):
    """What another program (or a hand) left under the cache's key orders nothing and stops nothing."""
    config = SimpleNamespace(cache=FakeCache({SECONDS_KEY: stored}))
    assert machine_share.last_seconds(config) == read
    assert machine_share.last_seconds(SimpleNamespace()) == {}  # the cache plugin off


def test_the_chain_is_one_work_unit_and_every_other_file_its_own():
    chain = frozenset({"tests/slurm/test_cluster.py", "tests/integration/test_deadlines.py"})
    assert work_unit("tests/slurm/test_cluster.py::test_a", chain) == WHOLE_MACHINE_CHAIN
    assert work_unit("tests/integration/test_deadlines.py::test_b[p::q]", chain) == WHOLE_MACHINE_CHAIN
    assert work_unit("tests/unit/test_x.py::test_b[tests/slurm/test_cluster.py]", chain) == "tests/unit/test_x.py"
    assert work_unit("tests/unit/test_x.py::Class::test_c", chain) == "tests/unit/test_x.py"


def test_the_run_reports_how_busy_it_kept_the_machine():
    assert machine_use(1131.4, 2125.2, 2, 3) == ("the machine: 2,125 CPU-seconds busy in 1,131 s, 1.88 of its 2 cores "
                                                 "on average (3 xdist workers; every process on the machine counts)")
    assert "(no xdist workers;" in machine_use(10, 5, 2, None)
    before = machine_busy_seconds()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # busy for 0.3 CPU-seconds
        pass
    assert machine_busy_seconds() - before >= 0.25  # /proc/stat counts in clock ticks (0.01 s)
