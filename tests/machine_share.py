"""Share the machine's cores between pytest-xdist's workers (`pytest -n 2`, make test).

Each test holds the cores it keeps busy: `@pytest.mark.cores(n)`, else 1. A test asking for more
cores than the machine has holds all of them. So on 2 cores a test that keeps both
busy (a 4-rank test, a compile matrix) runs with the machine to itself, and one-core tests run two
at a time. A test's cores are what it measures: the machine's busy CPU seconds over wall seconds,
with the test alone on an idle machine and the warm Python on (TEST_CPU_LOG below), 2 from 1.45
up. Most 2-rank launches of the tiny model spend much of their time in one process (the launcher's
checks, a rank's start, checkpoint files) and keep 0.7 to 1.4 cores busy; tests whose timing
against a deadline is what they check hold the machine too.
Overcommitting the cores would make ranks' collectives and tests' deadlines wait on each other:
slower, and flaky where a test times a signal, a restart or a stall.

The cores are lock files, one per core, in a folder of this test run (its xdist run id). A test
takes its cores while holding a turnstile lock, so a test waiting for the whole machine is not
overtaken by one-core tests; locks held by a process die with it. A worker holding the whole
machine keeps it for its next test when that one needs the whole machine too and the test it just
ran was short (under SHORT_TEST_S), for at most STREAK_S: a file of short multi-process tests (or
of checks of one module-scoped run) then waits for the other worker once, not before each test,
and the other worker waits no longer than a streak. Long whole-machine tests take turns with the
other worker's tests as one-core tests do: a one-core test always gives its core back, so that a
test waiting for the whole machine gets it next. Without xdist nothing is locked.
TEST_CORES sets the number of cores (default: those this process may run on).

The order in which the workers get the files (xdist's loadfile hands out whole files, in the order
of the collection, which this plugin sets): first the files whose tests mostly hold the whole
machine, so that they wait only for each other and not for a one-core test on the other worker;
then the others, integration tests before the protocol's and the unit tests, each folder's files
with the most tests first. The long one-core files (a power study, the GPU suite's smoke run) then
start early, and the many short unit tests fill the end, where the workers would otherwise wait
for one long test.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest


def machine_cores() -> int:
    return int(os.environ.get("TEST_CORES") or len(os.sched_getaffinity(0)))


SHORT_TEST_S = 5.0  # a whole-machine test this short lets the next one keep the machine
STREAK_S = 30.0  # for at most this long from when the machine was taken


class CoreLocks:
    def __init__(self, folder: Path, cores: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = folder / "turnstile"
        self.cores = [folder / f"core-{index}" for index in range(cores)]
        self.held: dict[Path, object] = {}
        self.taken_at = 0.0  # when the cores held now were taken (time.monotonic)

    def take(self, wanted: int) -> None:
        """Hold `wanted` cores (at most the machine's), waiting at the turnstile for them; a
        worker that already holds that many keeps them."""
        wanted = max(1, min(wanted, len(self.cores)))
        if len(self.held) == wanted:
            return
        self.release()
        with open(self.turnstile, "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            while len(self.held) < wanted:
                for path in self.cores:
                    if len(self.held) < wanted and path not in self.held and (handle := self._try_lock(path)):
                        self.held[path] = handle
                if len(self.held) < wanted:
                    time.sleep(0.05)
        self.taken_at = time.monotonic()

    def release(self) -> None:
        for handle in self.held.values():
            handle.close()  # closing the file releases its lock
        self.held.clear()

    def keep_for(self, wanted: int, last_test_s: float) -> bool:
        """Whether the next test, which wants `wanted` cores, keeps what this worker holds (the
        module docstring says when)."""
        whole = len(self.cores)
        return (len(self.held) == whole and min(wanted, whole) == whole and last_test_s < SHORT_TEST_S
                and time.monotonic() - self.taken_at < STREAK_S)

    @staticmethod
    def _try_lock(path: Path):
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            handle.close()
            return None


LOCKS = pytest.StashKey[CoreLocks]()  # a worker's locks, set in pytest_configure


def cores_of(item: pytest.Item) -> int:
    mark = item.get_closest_marker("cores")
    return int(mark.args[0]) if mark is not None else 1


def pytest_configure(config):
    config.addinivalue_line("markers", "cores(n): the cores the test keeps busy, which it holds under "
                                       "pytest-xdist (tests/machine_share.py)")
    workerinput = getattr(config, "workerinput", None)  # set in xdist's workers only
    if workerinput is not None:
        folder = Path(tempfile.gettempdir()) / f"pytest-cores-{workerinput['testrunuid']}"
        config.stash[LOCKS] = CoreLocks(folder, machine_cores())
    elif getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # xdist's controller keeps the order set below


FOLDER_ORDER = ("slurm", "integration", "protocol", "unit")


@pytest.hookimpl(trylast=True)  # after the fast tier has chosen its tests (tests/conftest.py)
def pytest_collection_modifyitems(items):
    items[:] = in_file_order(items, machine_cores(), Path(__file__).parent)


def in_file_order(items: list, whole_machine: int, suite: Path) -> list:
    """The files in the order the module docstring gives; the tests of a file keep theirs."""
    files: dict[Path, list] = {}
    for item in items:
        files.setdefault(Path(item.path), []).append(item)

    def order(path_and_tests: tuple[Path, list]) -> tuple:
        path, tests = path_and_tests
        holding = sum(cores_of(test) >= whole_machine for test in tests)
        folder = path.relative_to(suite).parts[0] if path.is_relative_to(suite) else ""
        rank = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
        return (2 * holding < len(tests), rank, -len(tests))

    return [item for _, tests in sorted(files.items(), key=order) for item in tests]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    locks = item.config.stash.get(LOCKS, None)
    if locks is not None:
        locks.take(cores_of(item))
    started = time.monotonic()
    try:
        with busy_cores_logged(item):
            yield
    finally:
        if locks is not None:
            seconds = time.monotonic() - started
            if nextitem is None or not locks.keep_for(cores_of(nextitem), seconds):
                locks.release()


@contextmanager
def busy_cores_logged(item: pytest.Item):
    """With TEST_CPU_LOG=FILE, a JSON line per test: its wall seconds, the CPU seconds of its process
    and of the processes it started and waited for, and the whole machine's busy CPU seconds (what a
    `cores` mark is chosen from, measured with the test alone: TEST_WORKERS=0). The machine's count
    includes what the process's own count cannot see: forks of the warm Python (tests/warm_python),
    a SLURM job's processes. Its start (Unix time) and xdist worker place it on the run's timeline."""
    path = os.environ.get("TEST_CPU_LOG")
    if not path:
        yield
        return
    start, wall, before, machine = time.time(), time.monotonic(), os.times(), machine_busy_seconds()
    try:
        yield
    finally:
        after = os.times()
        cpu = sum(after[:4]) - sum(before[:4])
        with open(path, "a") as log:
            log.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - wall, 2),
                                  "cpu": round(cpu, 2), "machine_cpu": round(machine_busy_seconds() - machine, 2),
                                  "cores": cores_of(item), "start": round(start, 2),
                                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since it started (/proc/stat: all but
    idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")
