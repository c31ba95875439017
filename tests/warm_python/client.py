"""The client of the suite's warm Python (tests/warm_python/__init__.py): what the tests' child
processes run as `sys.executable`. It is started with `-I -S` (stdlib only, milliseconds) by a
script that names the real interpreter, and either

- asks the server of its slot to fork `python [-u] -m MODULE ARGS` or `python [-u] SCRIPT ARGS`
  with its descriptors, directory and environment, passes the signals it gets on to that process
  and ends as it ends (the same exit code, or killed by the same signal); or
- when the request is another form of the command line, the warm Python is off (TEST_WARM_PYTHON
  empty), no server runs or the server refuses (its fork would differ from a fresh interpreter),
  replaces itself with the real interpreter: exactly what runs without the warm Python. A server
  that is still importing is waited for (seconds): its fork costs less than a fresh interpreter.

The slot is the process's LOCAL_RANK (else RANK, else 0) modulo the servers: each server has its own
hash seed, so the ranks of a run up to that size iterate sets of strings in different orders, as
fresh interpreters do.
"""

import json
import os
import resource
import signal
import socket
import struct
import sys
import time

FORWARDED = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGWINCH]
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How multiprocessing's fork server and resource tracker begin their `-c` code.
MULTIPROCESSING_SERVERS = ("from multiprocessing.forkserver import main",
                           "from multiprocessing.resource_tracker import main")
MAX_INHERITED = 61  # descriptors past 0, 1 and 2 (the server takes 64 with a request)
STARTING_WAIT_S = 120  # at most, for a server that is still importing (seconds, normally)
LIMITS = ["RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_NOFILE",
          "RLIMIT_STACK"]


def main(real_python: str, argv: list[str]) -> None:
    inherited = inherited_descriptors()  # before this client opens any
    main_of = parse(argv)
    folder = os.environ.get("TEST_WARM_PYTHON", "")
    if main_of is None or not folder or len(inherited) > MAX_INHERITED:
        start_real(real_python, argv)
    connection = connect(folder)
    if connection is None:
        start_real(real_python, argv)
    die_with_the_launcher()
    unbuffered, kind, target, args = main_of
    request = {"main": [kind, target], "args": args, "unbuffered": unbuffered, "cwd": os.getcwd(),
               "env": dict(os.environ), "umask": current_umask(), "executable": sys.argv[0], "descriptors": inherited,
               "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}}
    # Signals that come before the process exists wait for it.
    pending, forked = [], []
    for number in FORWARDED:
        signal.signal(number, lambda number, _: pass_on(connection, number) if forked else pending.append(number))
    body = json.dumps(request).encode()
    socket.send_fds(connection, [struct.pack("!I", len(body)) + body], [0, 1, 2, *inherited])
    reader = connection.makefile("rb")
    if not reader.readline().startswith(b"ok "):
        connection.close()
        for number in FORWARDED:
            signal.signal(number, signal.SIG_DFL)
        for number in pending:  # what they would have done to the real interpreter at its start
            os.kill(os.getpid(), number)
        start_real(real_python, argv)
    forked.append(True)
    for number in pending:
        pass_on(connection, number)
    line = reader.readline().decode()
    end_as(int(line.split()[1]) if line.startswith("exit ") else signal.SIGKILL)  # the relay died: as if killed


def parse(argv: list[str]):
    """(unbuffered, "module" | "code" | "script", MODULE | CODE | SCRIPT, ARGS) for `[-u] -m MODULE
    ARGS`, `[-u] -c CODE ARGS` where CODE is how multiprocessing starts its fork server or resource
    tracker, or `[-u] SCRIPT ARGS`; None for any other command line. (Other code run with -c stays
    a real interpreter: the tests use it for what only a fresh one shows, such as what a module
    imports or the memory a reader takes.)"""
    unbuffered = bool(argv) and argv[0] == "-u"
    rest = argv[1:] if unbuffered else argv
    if len(rest) >= 2 and rest[0] == "-m":
        return unbuffered, "module", rest[1], rest[2:]
    if len(rest) >= 2 and rest[0] == "-c" and rest[1].startswith(MULTIPROCESSING_SERVERS):
        return unbuffered, "code", rest[1], rest[2:]
    if rest and rest[0].endswith(".py") and not rest[0].startswith("-"):
        return unbuffered, "script", rest[0], rest[1:]
    return None


def inherited_descriptors() -> list[int]:
    """The descriptors past 0, 1 and 2 that this process was started with (multiprocessing passes
    its fork server a listening socket and a pipe): the fork gets them at the same numbers."""
    return sorted(fd for fd in map(int, os.listdir("/proc/self/fd")) if fd > 2 and is_open(fd))


def is_open(fd: int) -> bool:
    """False for the descriptor that listed /proc/self/fd, closed since."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def connect(folder: str):
    slots = int(os.environ.get("TEST_WARM_PYTHON_SLOTS", "1"))
    rank = os.environ.get("LOCAL_RANK") or os.environ.get("RANK") or "0"
    slot = int(rank) % slots if rank.isdigit() else 0
    path = os.path.join(folder, f"slot-{slot}.sock")
    deadline = time.monotonic() + STARTING_WAIT_S
    while not os.path.exists(path) and server_starting(os.path.join(folder, f"slot-{slot}.pid")):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return None
    return connection


def server_starting(pid_file: str) -> bool:
    """Whether the server that `pid_file` names (written when it was started) still runs: it
    is importing, and its socket comes once it is ready."""
    try:
        with open(pid_file) as f:
            return running(int(f.read()))
    except (OSError, ValueError):
        return False


def running(pid: int) -> bool:
    """Whether the process runs: neither gone nor a zombie (a process that ended, until its parent
    reaps it). It may go between any two looks at /proc, so /proc is read once."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def die_with_the_launcher() -> None:
    """A rank dies with its launcher (trainer/launch/launcher_watch.py), through the kernel's
    parent-death signal to its process; here that process is this client, whose end takes the
    fork with it."""
    if os.environ.get("TRAINER_LAUNCHER_PID") == str(os.getppid()):
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the line above
            os._exit(128 + signal.SIGKILL)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def pass_on(connection: socket.socket, number: int) -> None:
    try:
        connection.sendall(f"signal {number}\n".encode())
    except OSError:
        pass


def end_as(status: int) -> None:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def start_real(real_python: str, argv: list[str]) -> None:
    os.execv(real_python, [real_python, *argv])
