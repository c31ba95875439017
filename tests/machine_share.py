"""Share the machine's cores between pytest-xdist's workers (`pytest -n auto`, make test).

Each test holds the slots of the cores it keeps busy: `@pytest.mark.cores(n)`, else 1, at most the
machine's cores; a test marked `alone` holds every slot. A test's cores are what it measures: the
machine's busy CPU seconds over wall seconds, with the test alone on an idle machine and the warm
Python on (TEST_CPU_LOG below), 2 from 1.45 up. Most 2-rank launches of the tiny model spend much of
their time in one process (the launcher's checks, a rank's start, checkpoint files) and keep 0.7 to
1.4 cores busy, and a test that keeps "both" cores busy keeps 1.3 to 1.8 of them busy: so the
machine has more slots than cores (TEST_SLOTS, default 1.5 a core: 3 on 2 cores), and as many
xdist workers as slots. On 2 cores a 2-core test runs beside a one-core test, and three one-core
tests run together: the cores their waits leave idle are used, at the price of each test's
seconds (a rank's collectives wait for a peer that shares a core). Tests whose timing against a
deadline is what they check (a stall, a kill, a collective's timeout) are marked `alone`: nothing
runs beside them.

The slots are lock files, one per slot, in a folder of this test run (its xdist run id). A test
takes its slots while holding a turnstile lock, so a test waiting for several slots is not
overtaken by one-slot tests; locks held by a process die with it. A test that wants more than half
of the slots (a 2-core test on 2 cores) first takes the `big` lock, without the turnstile: two of
them cannot run together anyway, and one waiting for the other at the turnstile would leave the
third slot idle. A worker holding a big test's slots keeps them for its next test when that one
wants as many and the test it just ran was short (under SHORT_TEST_S), for at most STREAK_S, and
always when both are `alone`: a file of short multi-process tests (or of checks of one
module-scoped run), or the `alone` tests one after the other, then wait for the others once, not
before each test. That wait (the drain) costs the machine what the others' running tests leave
idle: up to a long test's length at one core. Without xdist nothing is locked.
TEST_CORES sets the number of cores (default: those this process may run on).

Which worker runs what: xdist's loadfile hands out whole files, in the order of the collection,
which this plugin sets. The files whose tests mostly want more than half the slots, and those
marked `chain` (pytestmark) that have one such test, form one chain (one work unit,
WHOLE_MACHINE_CHAIN), which one worker runs from the start, one file after the other (the files of
`alone` tests first, at the start, where the others have run no long test yet: one short drain for
all of them; then its integration files before its SLURM file, which loads what the compile matrix
compiled): the others' one-slot tests run beside each of its tests, where files of big tests handed
to several workers would wait for each other with nothing beside them. The other files follow,
integration tests before the protocol's and the unit tests, each folder's files with the most tests
first. The long one-slot files (a power study, the GPU suite's smoke run) then start early, and the
many short unit tests fill the end, where the workers would otherwise wait for one long test.
Where pytest's cache (.pytest_cache) holds the seconds each test took when it last ran, the files
outside the chain go longest first instead (the seconds of the tests this run selected), whatever
their folder: a long file of few tests (flex attention's compiled kernel) no longer starts last.
Every run with the cache on records its tests' seconds; a checkout without it keeps the order above.
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
    return count_from_environment("TEST_CORES") or len(os.sched_getaffinity(0))


SLOTS_PER_CORE = 1.5  # see the module docstring


def machine_slots() -> int:
    return count_from_environment("TEST_SLOTS") or max(1, round(machine_cores() * SLOTS_PER_CORE))


def count_from_environment(name: str) -> int | None:
    """The positive whole number the variable `name` sets, None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdecimal() or int(value) < 1:  # isdecimal: exactly what int() reads (not "²")
        raise pytest.UsageError(f"{name}={value!r}: must be a whole number of at least 1 (unset: this machine's)")
    return int(value)


def is_big(wanted: int, slots: int) -> bool:
    """Whether a test of `wanted` slots wants more than half of the machine's: two cannot run together."""
    return 2 * min(wanted, slots) > slots


SHORT_TEST_S = 5.0  # a big test this short lets the next one keep the slots
STREAK_S = 30.0  # for at most this long from when they were taken


class SlotLocks:
    def __init__(self, folder: Path, slots: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = folder / "turnstile"
        self.big_lock = folder / "big"
        self.slots = [folder / f"slot-{index}" for index in range(slots)]
        self.held: dict[Path, object] = {}
        self.big = None  # the big lock's handle while held
        self.taken_at = 0.0  # when the slots held now were taken (time.monotonic)

    def take(self, wanted: int) -> None:
        """Hold `wanted` slots (at most the machine's): a big test first takes the big lock, then
        each waits at the turnstile for its slots; a worker that already holds as many keeps them."""
        wanted = max(1, min(wanted, len(self.slots)))
        if len(self.held) == wanted:
            return
        self.release()
        if is_big(wanted, len(self.slots)):
            self.big = open(self.big_lock, "a")
            fcntl.flock(self.big, fcntl.LOCK_EX)
        with open(self.turnstile, "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            while len(self.held) < wanted:
                for path in self.slots:
                    if len(self.held) < wanted and path not in self.held and (handle := self._try_lock(path)):
                        self.held[path] = handle
                if len(self.held) < wanted:
                    time.sleep(0.05)
        self.taken_at = time.monotonic()

    def release(self) -> None:
        for handle in self.held.values():
            handle.close()  # closing the file releases its lock
        self.held.clear()
        if self.big is not None:
            self.big.close()
            self.big = None

    def keep_for(self, wanted: int, last_test_s: float, both_alone: bool = False) -> bool:
        """Whether the next test, which wants `wanted` slots, keeps what this worker holds (the
        module docstring says when); `both_alone`: it and the test just run are `alone`."""
        if self.big is None or len(self.held) != min(wanted, len(self.slots)):
            return False
        # Between two `alone` tests the others would only start tests the second must wait for.
        return both_alone or (last_test_s < SHORT_TEST_S and time.monotonic() - self.taken_at < STREAK_S)

    @staticmethod
    def _try_lock(path: Path):
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            handle.close()
            return None


LOCKS = pytest.StashKey[SlotLocks]()  # a worker's locks, set in pytest_configure


def cores_of(item: pytest.Item) -> int:
    mark = item.get_closest_marker("cores")
    return int(mark.args[0]) if mark is not None else 1


def is_alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None


def slots_of(item: pytest.Item, cores: int, slots: int) -> int:
    """The slots a test holds on a machine of `cores` cores and `slots` slots."""
    return slots if is_alone(item) else min(cores_of(item), cores)


def run_folder(testrunuid: str) -> Path:
    """The folder of this test run's locks and of the chain's files."""
    return Path(tempfile.gettempdir()) / f"pytest-cores-{testrunuid}"


def pytest_configure(config):
    config.addinivalue_line("markers", "cores(n): the cores the test keeps busy, which it holds under "
                                       "pytest-xdist (tests/machine_share.py)")
    config.addinivalue_line("markers", "alone: timed against a deadline; no other test runs beside it "
                                       "under pytest-xdist (tests/machine_share.py)")
    config.addinivalue_line("markers", "chain: the file runs in the chain of big tests when any of its tests "
                                       "is big, not only when most are (tests/machine_share.py)")
    workerinput = getattr(config, "workerinput", None)  # set in xdist's workers only
    if workerinput is not None:
        config.stash[LOCKS] = SlotLocks(run_folder(workerinput["testrunuid"]), machine_slots())
        return
    config.stash[RUN_START] = (time.monotonic(), machine_busy_seconds())
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # xdist's controller keeps the order set below


RUN_START = pytest.StashKey[tuple]()  # (monotonic seconds, the machine's busy CPU seconds) at the start


def pytest_terminal_summary(terminalreporter, config):
    """How busy the run kept the machine: what the slots are for."""
    if (start := config.stash.get(RUN_START, None)) is not None:
        wall, busy = time.monotonic() - start[0], machine_busy_seconds() - start[1]
        terminalreporter.write_line(machine_use(wall, busy, machine_cores(), getattr(config.option, "numprocesses", 0)))


def machine_use(wall: float, busy: float, cores: int, workers: int | None) -> str:
    return (f"the machine: {busy:,.0f} CPU-seconds busy in {wall:,.0f} s, {busy / max(wall, 1e-9):.2f} of its {cores} "
            f"cores on average ({workers or 'no'} xdist workers; every process on the machine counts)")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per slot."""
    return machine_slots()


WHOLE_MACHINE_CHAIN = "whole-machine-chain"  # the work unit of the files of big tests
CHAIN_FILES = "chain-files.txt"  # in the run's folder: the chain's files, as the workers collected them


def pytest_xdist_make_scheduler(config, log):
    """loadfile's scheduling, with the files of the chain as one work unit. The controller sees only
    the tests' ids: the workers write which files the chain has (CHAIN_FILES) when they collect,
    before the controller schedules."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndChain(LoadFileScheduling):
        chain: frozenset = frozenset()

        def schedule(self) -> None:
            if self.collection is None and self.nodes:  # the first call, once every worker collected
                folder = run_folder(self.nodes[0].workerinput["testrunuid"])
                self.chain = frozenset((folder / CHAIN_FILES).read_text().split("\n"))
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, self.chain)

    return FilesAndChain(config, log)


def work_unit(nodeid: str, chain: frozenset) -> str:
    """The chain for a test of one of its files, else the test's file (loadfile's unit)."""
    file = nodeid.split("::", 1)[0]
    return WHOLE_MACHINE_CHAIN if file in chain else file


# The chain's integration files before its SLURM file: the compile matrix builds the kernels and
# graphs that the SLURM smoke's compiled set then loads from the run's compile cache.
FOLDER_ORDER = ("integration", "slurm", "protocol", "unit")


# In pytest's cache: node id -> the seconds the test took (setup, call and teardown) when it last ran.
SECONDS_KEY = "machine_share/test_seconds"
_seconds_this_run: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds_this_run[report.nodeid] = _seconds_this_run.get(report.nodeid, 0.0) + report.duration


def last_seconds(config) -> dict[str, float]:
    """The cache's seconds per test; a value that is not such a table (a damaged or foreign file)
    counts as none, and an entry that is not a number is left out."""
    cache = getattr(config, "cache", None)
    known = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    if not isinstance(known, dict):
        return {}
    return {test: float(s) for test, s in known.items() if isinstance(s, (int, float)) and not isinstance(s, bool)}


def pytest_configure_node(node):
    """xdist's controller reads the seconds once and hands them to every worker: workers that read
    the file themselves could see two versions of it (another run in this checkout writing it as
    they collect), order the files differently, and xdist would stop the run."""
    node.workerinput[SECONDS_KEY] = last_seconds(node.config)


def pytest_sessionfinish(session):
    """The process that reports the run (xdist's controller, or the only one) adds this run's
    seconds to the cache's; the tests of files that no longer exist are dropped."""
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not _seconds_this_run:
        return
    root = session.config.rootpath
    known = {**last_seconds(session.config), **{test: round(s, 2) for test, s in _seconds_this_run.items()}}
    cache.set(SECONDS_KEY, {test: s for test, s in known.items() if (root / test.split("::", 1)[0]).is_file()})


@pytest.hookimpl(trylast=True)  # after the fast tier has chosen its tests (tests/conftest.py)
def pytest_collection_modifyitems(config, items):
    cores, slots = machine_cores(), machine_slots()
    workerinput = getattr(config, "workerinput", None)
    seconds = workerinput.get(SECONDS_KEY, {}) if workerinput is not None else last_seconds(config)
    items[:] = in_file_order(items, lambda item: slots_of(item, cores, slots), slots, Path(__file__).parent,
                             seconds)
    if workerinput is not None:
        chain = "\n".join(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items if in_chain(item)))
        written = run_folder(workerinput["testrunuid"]) / f"{CHAIN_FILES}.{workerinput['workerid']}"
        written.write_text(chain)
        written.replace(written.with_name(CHAIN_FILES))  # whole, whichever worker writes last


IN_CHAIN = pytest.StashKey[bool]()


def in_chain(item) -> bool:
    return item.stash.get(IN_CHAIN, False)


def in_file_order(items: list, slots_of_test, slots: int, suite: Path,
                  seconds: dict[str, float] | None = None) -> list:
    """The files in the order the module docstring gives, with `seconds` (node id -> the seconds its
    test last took) where known; the tests of a file keep theirs. The files of the chain (first)
    are marked in their tests' stash (IN_CHAIN)."""
    seconds = seconds or {}
    files: dict[Path, list] = {}
    for item in items:
        files.setdefault(Path(item.path), []).append(item)
    for tests in files.values():  # a file of mostly big tests is the chain's, and one marked `chain` with any
        big = sum(is_big(slots_of_test(test), slots) for test in tests)
        chained = 2 * big >= len(tests) or (big > 0 and any(test.get_closest_marker("chain") for test in tests))
        for test in tests:
            test.stash[IN_CHAIN] = chained

    def order(path_and_tests: tuple[Path, list]) -> tuple:
        path, tests = path_and_tests
        folder = path.relative_to(suite).parts[0] if path.is_relative_to(suite) else ""
        rank = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
        if in_chain(tests[0]):  # one work unit: its files' order is the compile cache's (FOLDER_ORDER)
            return (False, not all(is_alone(test) for test in tests), rank, 0.0, -len(tests))
        return (True, True, 0, -sum(seconds.get(test.nodeid, 0.0) for test in tests), rank, -len(tests))

    return [item for _, tests in sorted(files.items(), key=order) for item in tests]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    locks = item.config.stash.get(LOCKS, None)
    cores, slots = machine_cores(), machine_slots()
    if locks is not None:
        locks.take(slots_of(item, cores, slots))
    started = time.monotonic()
    try:
        with busy_cores_logged(item):
            yield
    finally:
        if locks is not None:
            seconds = time.monotonic() - started
            both_alone = nextitem is not None and is_alone(item) and is_alone(nextitem)
            if nextitem is None or not locks.keep_for(slots_of(nextitem, cores, slots), seconds, both_alone):
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
