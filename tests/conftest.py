"""Measured figures from the tests, printed at the end of the run (pytest captures test output)."""

from __future__ import annotations

import os

import pytest

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
