"""The suite's settings: one thread per process (torch.compile too builds its kernels in the
process), a compile cache of the run's own, the cores its xdist workers share (tests/machine_share.py),
measured figures printed at the end of the run (pytest captures test output), and the fast tier
(`--fast`, make test-fast)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (`-n 2`), the workers share the cores: tests/machine_share.py.
pytest_plugins = ["tests.machine_share", "tests.warm_python"]

# Every process of the suite computes with one thread, this one and those the tests start (they
# inherit the variable): what the launcher gives each of several processes. The tests' models are
# small, and where other work shares the 2 cores a lone process's two threads wait on each other:
# a one-process run of the tiny model took 4 times the time and 3 times the CPU with two threads,
# computing the same numbers (bitwise). Set OMP_NUM_THREADS to run them with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file: the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# And torch.compile builds its kernels in the compiling process, not in a pool of compile
# processes per process (what inductor starts by default, one worker per core): on 2 cores the
# ranks that compile mostly keep both busy, and a pool costs its start. (The compile matrix's 2
# ranks, which wait for each other's kernel builds, set 2: tests/integration/test_compile_parity.py.)
# Set before the warm Python's servers start, which then serve the compiling processes too
# (inductor reads the variable when it is imported).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# torch.compile's cache: a folder of this run, which its tests share (a kernel one test built,
# another loads) and which goes with the run, unless TORCHINDUCTOR_CACHE_DIR names one. Not the
# machine's /tmp/torchinductor_<user>: what an earlier run left there would make a run warmer and
# faster than on a fresh machine, and pass on what only a warm cache does. Set here, in the process
# that starts the run (xdist's workers and the warm Python's servers inherit it).
_run_compile_cache = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _run_compile_cache = tempfile.mkdtemp(prefix="pytest-compile-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _run_compile_cache

# tests/cuda trains on one accelerator (tests/cuda/conftest.py): collected only when
# TRAINER_TEST_DEVICE names the device (cuda, or cpu to check the tests' logic), so the default
# run neither collects nor skips it.
collect_ignore = [] if os.environ.get("TRAINER_TEST_DEVICE") else ["cuda"]

_MEASURED: list[str] = []


@pytest.fixture
def measured(request):
    """Record a line (a measured figure or a table row) for the end-of-run summary. The line travels
    with the test's report, so under pytest-xdist it reaches the summary from the worker too."""
    return lambda line: request.node.user_properties.append(("measured", line))


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the last report of a test carries all its lines
        _MEASURED.extend(value for name, value in report.user_properties if name == "measured")


def pytest_unconfigure(config):
    if _run_compile_cache is not None:  # the process that made it, once the run is over
        shutil.rmtree(_run_compile_cache, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier (make test-fast): every test under tests/unit, those under tests/protocol "
                          "not marked slow, and the tests marked smoke")


def pytest_configure(config):
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):  # runs tests
        from tests.ranks import name_every_user

        name_every_user()  # the process's one fork server serves all its users warm (tests/ranks.py)
    config.addinivalue_line("markers", "smoke: in the fast tier (`--fast`, make test-fast): a short test of a "
                                       "subsystem that the unit tests do not reach")
    config.addinivalue_line("markers", "slow: under tests/protocol, left out of the fast tier (it trains for real)")


FAST_FOLDERS = ("unit", "protocol")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and folder_of(item) != "protocol":
            raise pytest.UsageError(f"{item.nodeid}: only tests under tests/protocol may be marked slow "
                                    "(the fast tier runs every unit test)")
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        in_tier = item.get_closest_marker("smoke") or (folder_of(item) in FAST_FOLDERS
                                                       and not item.get_closest_marker("slow"))
        (kept if in_tier else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def folder_of(item: pytest.Item) -> str:
    """unit, protocol, integration, slurm, cuda: the folder under tests/ that holds the test."""
    return item.path.relative_to(Path(__file__).parent).parts[0]
