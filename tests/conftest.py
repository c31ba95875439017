"""Measured figures from the tests, printed at the end of the run (pytest captures test output)."""

from __future__ import annotations

import pytest

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
