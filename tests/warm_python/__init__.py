"""A warm Python for the suite's child processes: the tests' launches start their launcher and
ranks in milliseconds instead of importing torch and the trainer in each (3 s of CPU a rank).

The pytest process (xdist's controller under `-n`) starts SLOTS servers (tests/warm_python/server.py)
that import torch and the trainer once, and each process that runs tests points `sys.executable`
at a client script (tests/warm_python/client.py). A test's `[sys.executable, "-m", MODULE, ...]` or `python SCRIPT.py`,
and the launcher's ranks (which torch's agent starts with `sys.executable`), then run as forks of a
server: the same code, arguments, environment, directory, descriptors, limits, exit codes and
signals. Whatever a fork could not reproduce is refused by the server and started as a real
interpreter: another interpreter setting, a variable read at import (TORCH*, OMP_*, PYTHON*, ...),
another PYTHONPATH (a sitecustomize a test adds), a folder that shadows a module.
TEST_WARM_PYTHON_LOG=FILE collects the servers' log: each refusal and its reason.

Before serving, a server moves what it imported out of the garbage collector's sight (gc.freeze,
as Python's documentation advises for a process that forks): a fork's full collection then walks
only what the fork made, not the 300,000 imported objects (150-200 ms of CPU and a copy of every
page they are on, at each full collection of each fork).

Tests whose subject is the process boundary itself (the launcher's process tree, kills and signals
to it, stops, restarts) are marked `real_processes`: their processes are started as real
interpreters. TEST_WARM_PYTHON=0 turns the warm Python off for a whole run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SWITCH = "TEST_WARM_PYTHON"  # the servers' folder; empty: start real interpreters
# The interpreter itself: sys.executable before pytest_configure points it at the client (a pytest
# that a test starts may itself be a fork, whose sys.executable is the client).
REAL_PYTHON = os.environ.get(f"{SWITCH}_REAL") or sys.executable
SLOTS = 4  # servers per test run: ranks 0-3 of a launch get distinct hash seeds
# What the servers import before they fork: the launcher, a rank, torchrun, the protocol's driver.
PRELOAD = ["trainer.train", "trainer.launch.launcher", "trainer.launch.elastic_agent", "torch.distributed.run",
           "protocol.cli"]
# The environment of a child process that must be a real interpreter, whatever the test's mark.
REAL_PROCESSES = {SWITCH: ""}

_servers: list[subprocess.Popen] = []
_folder: list[Path] = []


def pytest_configure(config):
    """The process that runs the session (pytest, or xdist's controller) starts the servers, which
    then serve its workers too; each process that runs tests points sys.executable at the client."""
    config.addinivalue_line("markers", "real_processes: the test's child processes are real interpreters, "
                                       "not forks of the warm Python (tests/warm_python)")
    outer = os.environ.get(SWITCH, "")
    if outer == "0":
        return
    worker = hasattr(config, "workerinput")
    runs_tests = worker or not getattr(config.option, "numprocesses", None)
    # An xdist worker uses its controller's servers, a pytest run by a test those of the outer run.
    if worker or (outer and os.path.isdir(outer)):
        if outer and runs_tests:
            sys.executable = os.path.join(outer, "python")
        return
    folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
    # The tests launch with PYTHONPATH at the repository (torchrun_launch.sh, run_many).
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The servers' log (the requests they refused, and why): TEST_WARM_PYTHON_LOG, else in the folder.
    log = os.environ.get(f"{SWITCH}_LOG") or folder / "servers.log"
    _servers.extend(start_servers(folder, PRELOAD, SLOTS, env, log))
    _folder.append(folder)
    client = write_client(folder)
    os.environ.update({SWITCH: str(folder), f"{SWITCH}_SLOTS": str(SLOTS), f"{SWITCH}_REAL": REAL_PYTHON})
    if runs_tests:
        sys.executable = str(client)


def start_servers(folder: Path, preload: list[str], slots: int, env: dict[str, str],
                  log: Path | str) -> list[subprocess.Popen]:
    """`slots` servers listening in `folder` (slot-K.sock, once they have imported `preload`; until
    then slot-K.pid names the server a client waits for)."""
    env = {key: value for key, value in env.items() if key != SWITCH}
    servers = []
    with open(log, "a") as log_file:
        for slot in range(slots):
            # Started as a script: the `tests` package is not among what a fork has imported.
            servers.append(subprocess.Popen(
                [REAL_PYTHON, str(Path(__file__).parent / "server.py"), str(folder / f"slot-{slot}.sock"), *preload],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file))
            (folder / f"slot-{slot}.pid.new").write_text(str(servers[-1].pid))
            (folder / f"slot-{slot}.pid.new").rename(folder / f"slot-{slot}.pid")
    return servers


def write_client(folder: Path) -> Path:
    """The client as an executable: the real interpreter, isolated and without site (it starts
    in milliseconds), running tests/warm_python/client.py."""
    client = folder / "python"
    client.write_text(f"#!{REAL_PYTHON} -IS\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"import client\nclient.main({REAL_PYTHON!r}, sys.argv[1:])\n")
    client.chmod(0o755)
    return client


def pytest_unconfigure(config):
    for server in _servers:
        server.terminate()
    for server in _servers:
        server.wait()
    for folder in _folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A `real_processes` test (and the fixtures it sets up) starts real interpreters."""
    if not item.get_closest_marker("real_processes") or SWITCH not in os.environ:
        yield
        return
    folder = os.environ[SWITCH]
    os.environ[SWITCH] = ""
    try:
        yield
    finally:
        os.environ[SWITCH] = folder
