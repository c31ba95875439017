"""tests/launch.py's `describe`: what a failed run's assertion shows. A multi-process run's first
failure (a rank's traceback) comes before torchrun's report of every rank's exit, which alone can
fill the end that is shown."""

from __future__ import annotations

import subprocess

from tests.launch import describe

RANK_ERROR = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: the first failure\n"
TORCHRUN_REPORT = "".join(f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : -15\n" * 40 for rank in range(8))


def failed(stderr: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["torchrun"], 1, stdout="", stderr=stderr)


def test_the_first_traceback_is_shown_when_the_end_of_stderr_leaves_it_out():
    text = describe(failed("starting\n" + RANK_ERROR + TORCHRUN_REPORT + "Traceback (most recent call last):\n"))
    assert len(TORCHRUN_REPORT) > 4000  # the end shown is torchrun's report alone
    assert "RuntimeError: the first failure" in text
    assert text.index("the first traceback of stderr:") > text.index("stderr:\n")


def test_a_short_stderr_is_shown_once():
    text = describe(failed(RANK_ERROR))
    assert text.count("RuntimeError: the first failure") == 1 and "the first traceback" not in text
