"""Measured figures from the tests, printed at the end of the run (pytest captures test output)."""

from __future__ import annotations

import os
import sys

import pytest

# Under pytest-xdist (`-n 2`), the workers share the cores: tests/machine_share.py.
pytest_plugins = ["tests.machine_share"]

# Every process of the suite computes with one thread, this one and those the tests start (they
# inherit the variable): what the launcher gives each of several processes. The tests' models are
# small, and where other work shares the 2 cores a lone process's two threads wait on each other:
# a one-process run of the tiny model took 4 times the time and 3 times the CPU with two threads,
# computing the same numbers (bitwise). Set OMP_NUM_THREADS to run them with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file: the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tests/cuda trains on one accelerator (tests/cuda/conftest.py): collected only when
# TRAINER_TEST_DEVICE names the device (cuda, or cpu to check the tests' logic), so the default
# run neither collects nor skips it.
collect_ignore = [] if os.environ.get("TRAINER_TEST_DEVICE") else ["cuda"]

_MEASURED: list[str] = []


@pytest.fixture
def measured():
    """Record a line (a measured figure or a table row) for the end-of-run summary."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier (make test-fast): every test under tests/unit and the tests marked smoke")


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: in the fast tier (`--fast`, make test-fast): the short test of a "
                                       "subsystem that the unit tests do not reach")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        in_tier = "unit" in item.path.relative_to(config.rootpath).parts[:2] or item.get_closest_marker("smoke")
        (kept if in_tier else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
