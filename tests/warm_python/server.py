"""The server of the suite's warm Python (tests/warm_python/__init__.py): an interpreter that has
imported torch and the trainer once and forks a ready process for each `python [-u] -m MODULE ...`,
`python [-u] -c CODE ...` or `python [-u] SCRIPT.py ...` that a client asks for.

    python tests/warm_python/server.py SOCKET MODULE...

It imports the MODULEs, then listens on the Unix socket SOCKET (the path appears only once it
is ready, so a client that finds no socket starts a real interpreter). For each connection it forks
a relay, which reads the request (argv, cwd, environment, umask, resource limits and the client's
stdin, stdout and stderr), refuses it when the fresh interpreter would differ from a fork of this one
(`refusal`), else forks the process that runs the module and relays signals in and the exit status
out until it ends. The process it forks becomes what `python -m MODULE` would be: its own session,
the client's descriptors, directory, environment, limits and umask, default signal handlers, sys.argv
and sys.path as the interpreter sets them, the module run as __main__ (it is dropped from the
preloaded modules first, so it runs once, as in a fresh interpreter), then the exit a fresh one
makes: non-daemon threads joined, atexit handlers run, streams flushed, the exit code or the signal.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import gc
import importlib
import importlib.machinery
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
import types

# Read when the interpreter or a module starts (torch, its compilers, OpenMP, the locale,
# sys.path): a request whose value differs is refused, as the fork would keep this server's.
READ_AT_START = ("PYTHON", "TORCH", "PYTORCH", "ATEN_", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA", "NCCL", "GLOO",
                 "TRITON", "LD_", "LC_", "LANG", "TZ")
# ... and these, read when the packages beside them are imported: refused only where this server
# imported one of those, else the fork reads them at its own import, as a fresh interpreter does (a
# run logging to W&B offline, a dataset read with HF_HUB_OFFLINE set).
READ_AT_IMPORT = {"HF_": ("huggingface_hub", "datasets", "transformers"), "TRANSFORMERS": ("transformers",),
                  "TOKENIZERS": ("tokenizers",), "WANDB": ("wandb",)}
# ... except these, read when they are used: the elastic agent's settings for its ranks, the
# compile cache folder (read at each compile; the trainer sets it per rank itself), the CUDA
# allocator's settings (read when it starts), -u's variable
# (the streams are opened by the fork), the launcher's interpreter and PYTHONPATH (compared apart).
READ_WHEN_USED = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                  "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF", "PYTHONUNBUFFERED", "PYTHONPATH",
                  "CUDA_VISIBLE_DEVICES")  # read when CUDA starts, which the server refuses to have done
NOT_READ = ("PYTHON",)
# ... and these, read at import into one setting that the fork sets again from its own value (the
# compile matrix's ranks build kernels on 2 threads: tests/integration/test_compile_parity.py).
SET_AGAIN = ("TORCHINDUCTOR_COMPILE_THREADS",)
# The first line of a sitecustomize that a fork may run after this server's imports
# (declared_order_independent); any other sitecustomize on PYTHONPATH starts a real interpreter.
ORDER_INDEPENDENT = "# warm python: acts the same after the preloaded imports"
PR_SET_PDEATHSIG = 1
MAX_DESCRIPTORS = 64  # a request's: 0, 1, 2 and those its client inherited
VECTOR_ISA_FOLDER = "vector_isa"  # beside the sockets: see check_vector_instructions
# The signal dispositions of a fresh interpreter: this one's before it imports anything (SIGINT
# raises KeyboardInterrupt; SIGPIPE and SIGXFSZ are ignored, so a write past RLIMIT_FSIZE is an
# OSError). Each fork starts with them.
FRESH_SIGNALS = {number: signal.getsignal(number) for number in signal.valid_signals()
                 if number not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(number) is not None}


def main() -> None:
    path, modules = sys.argv[1], sys.argv[2:]
    for module in modules:
        importlib.import_module(module)
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if "." not in name and name != "__main__" and spec is not None and spec.has_location:  # not built in
            TOP_LEVEL[name] = os.path.realpath(spec.origin)
            if installed_origin(name) == TOP_LEVEL[name]:
                FOUND_BY_INSTALLATION.add(name)
    if threading.active_count() != 1:  # a fork would lose them: serve nothing, clients start real interpreters
        sys.exit(f"warm python: importing {modules} started threads; not serving")
    if cuda_started():  # it read CUDA_VISIBLE_DEVICES and holds a context that a fork cannot use
        sys.exit(f"warm python: importing {modules} started CUDA; not serving")
    start_env = dict(os.environ)
    die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".starting")
    listener.listen(64)
    os.rename(path + ".starting", path)  # from here on a client waits for its accept (seconds at most)
    if "torch" in sys.modules:  # after TOP_LEVEL (see check_vector_instructions), before SIGCHLD is ignored
        check_vector_instructions(os.path.join(os.path.dirname(path), VECTOR_ISA_FOLDER))
        if threading.active_count() != 1:
            sys.exit("warm python: the vector instruction check started threads; not serving")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the relays are reaped by the kernel
    # Out of the collector's sight: a fork's full collections walk only what it made (the module docstring).
    gc.collect()
    gc.freeze()
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent(signal.SIGKILL)
            relay(connection, start_env)  # never returns
        connection.close()


def check_vector_instructions(folder: str) -> None:
    """inductor's check of the vector instructions that this CPU and compiler take, which it makes
    once per process at its first compile on the CPU: a g++ build and a load of a test program per
    instruction set, 7 s of CPU. It is the machine's, the same in every process: made here, a fork
    that compiles does not make it again. The check builds into `folder`, shared by the servers of
    a test run: the first builds, the others load what it built.

    The build imports what inductor's C++ builder imports (setuptools, which puts its vendored
    packages on sys.path, packaging, filelock): what a fresh interpreter imports at its first
    compile on the CPU, from the same installation. They are not among the modules a request's
    sys.path is checked against (TOP_LEVEL, recorded before), which would refuse every request
    for the vendored ones; a fork's sys.path is the request's, without the vendored folder."""
    from torch._inductor import cpu_vec_isa

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        cpu_vec_isa.valid_vec_isa_list()  # its result, and each instruction set's, cached in the process
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def cuda_started() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return torch.cuda.is_initialized() or getattr(torch.cuda, "_cached_device_count", None) is not None


def die_with_parent(how: int = signal.SIGTERM) -> None:
    """The server with the pytest process that started it; a relay with its server, the fork with
    its relay: nothing outlives the test run."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, how)
    if os.getppid() == 1:
        os._exit(0)


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(connection, 1 << 16, MAX_DESCRIPTORS)
    size = struct.unpack("!I", head[:4])[0]
    body = head[4:]
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            raise EOFError("the client went away")
        body += chunk
    return json.loads(body), fds


def relay(connection: socket.socket, start_env: dict[str, str]) -> None:
    code = 0
    try:
        request, fds = receive(connection)
        why = refusal(request, start_env) or lost_descriptors(request, fds)
        if why:  # in the servers' log: what runs as a real interpreter, and why
            print(f"refused {' '.join(request['main'])}: {why}", file=sys.stderr, flush=True)
            connection.sendall(f"no {why}\n".encode())
        else:
            pid = os.fork()
            if pid == 0:
                become(request, fds, connection)  # never returns
            for fd in fds:
                os.close(fd)
            connection.sendall(f"ok {pid}\n".encode())
            relay_until_exit(connection, pid, request)
    except BaseException:  # noqa: BLE001 (a relay must never return into the server's loop)
        traceback.print_exc()
        code = 1
    os._exit(code)


def relay_until_exit(connection: socket.socket, pid: int, request: dict) -> None:
    """Signals from the client to the process; its exit status to the client. A client that
    goes away (killed) takes the process with it. The CPU log's line is written before the
    client learns of the exit, so whoever waited for the process finds it."""
    exited = os.pidfd_open(pid)
    pending = b""
    while True:
        ready, _, _ = select.select([connection, exited], [], [])
        if exited in ready:
            _, status, usage = os.wait4(pid, 0)
            log_cpu(request, usage)
            connection.sendall(f"exit {status}\n".encode())
            return
        data = connection.recv(4096)
        if not data:
            os.kill(pid, signal.SIGKILL)
            log_cpu(request, os.wait4(pid, 0)[2])
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                os.kill(pid, int(line.split()[1]))
            except ProcessLookupError:
                pass


def log_cpu(request: dict, usage: resource.struct_rusage) -> None:
    """With TEST_CPU_LOG=FILE (tests/machine_share.py), a JSON line per fork: the CPU seconds it
    and the children it waited for used, and the test whose process started it (a module-scoped
    fixture's processes count for the test that set it up). A fork runs outside the tests' process
    tree, so their own CPU count cannot see it; benchmarks/suite_cpu.py adds the two."""
    path = os.environ.get("TEST_CPU_LOG")
    if not path:
        return
    test = request["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"fork": " ".join(request["main"]), "test": test,
                       "cpu": round(usage.ru_utime + usage.ru_stime, 3)})
    with open(path, "a") as log:
        log.write(line + "\n")


def read_at_start(imported) -> tuple[str, ...]:
    """The prefixes of the settings that the modules `imported` (this server's) have read."""
    return READ_AT_START + tuple(prefix for prefix, packages in READ_AT_IMPORT.items()
                                 if any(package in imported for package in packages))


def refusal(request: dict, start_env: dict[str, str]) -> str:
    """Why a fork of this server would not be the interpreter the request starts ('' when it would)."""
    env = request["env"]
    read = read_at_start(sys.modules)
    for name in sorted(set(env) | set(start_env)):
        if (name.startswith(read) and not name.startswith(READ_WHEN_USED) and name not in NOT_READ
                and name not in SET_AGAIN):
            if env.get(name) != start_env.get(name):
                return f"{name} differs"
    why = imports_differ([first_entry(request), *python_path(env)], request["cwd"])
    if why:
        return why
    for name, (_, hard) in request["limits"].items():
        _, our_hard = resource.getrlimit(getattr(resource, name))
        if our_hard != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > our_hard):
            return f"{name} above this server's"
    return ""


def lost_descriptors(request: dict, fds: list[int]) -> str:
    """'' when every descriptor the client sent arrived (0, 1, 2 and those it inherited)."""
    sent = 3 + len(request["descriptors"])
    return "" if len(fds) == sent else f"{sent - len(fds)} of its {sent} descriptors did not arrive"


def python_path(env: dict[str, str]) -> list[str]:
    """PYTHONPATH's entries, each once (torchrun_launch.sh puts the repository first again)."""
    return list(dict.fromkeys(entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry))


def first_entry(request: dict) -> str:
    """sys.path[0] of a fresh interpreter: the working directory for -m, '' (the working directory
    as it will be) for -c, else the script's folder."""
    kind, target = request["main"]
    if kind == "module":
        return request["cwd"]
    if kind == "code":
        return ""
    return os.path.dirname(os.path.realpath(os.path.join(request["cwd"], target)))


def imports_differ(entries: list[str], cwd: str) -> str:
    """Why an interpreter whose sys.path starts with `entries` (then the installation's) would
    import one of this server's top-level modules from another file, or a sitecustomize; '' if not."""
    entries = list(dict.fromkeys(os.path.join(cwd, entry) for entry in entries))
    listings = {entry: set(os.listdir(entry)) if os.path.isdir(entry) else set() for entry in entries}
    for entry in entries[1:]:  # PYTHONPATH's: the interpreter's start imports a sitecustomize from there
        if listings[entry] & {"sitecustomize.py", "usercustomize.py"}:
            if not declared_order_independent(os.path.join(entry, "sitecustomize.py")):
                return f"{entry} holds a sitecustomize"
            break  # the first one found is the one the start imports
    for name, origin in TOP_LEVEL.items():
        found = next((found for entry in entries if (found := module_file(entry, listings[entry], name))), None)
        if found is None and name not in FOUND_BY_INSTALLATION:
            return f"{name} ({origin}) would not be found"
        if found is not None and os.path.realpath(found) != origin:
            return f"{name} would be {found}, not {origin}"
    return ""


def declared_order_independent(path: str) -> bool:
    """Whether the sitecustomize at `path` (and no usercustomize beside it) says in its first line
    that it acts the same run after this server's imports as before them: it patches classes, or
    module globals that are looked up when called, never a name another module has already bound.
    A fork imports it before it runs the module (run_sitecustomize); a fresh interpreter would have
    imported it first of all. This server must not have imported one itself."""
    if "sitecustomize" in sys.modules or os.path.exists(os.path.join(os.path.dirname(path), "usercustomize.py")):
        return False
    try:
        with open(path) as f:
            return f.readline().rstrip("\n") == ORDER_INDEPENDENT
    except (OSError, UnicodeDecodeError):  # unreadable, or not text: not declared
        return False


def run_sitecustomize() -> None:
    """Import a PYTHONPATH folder's sitecustomize as the interpreter's start does (sys.path[0]
    is not searched yet; an error other than its absence is printed, and the start goes on)."""
    first, sys.path[:] = sys.path[0], sys.path[1:]
    try:
        try:
            import sitecustomize  # noqa: F401
        except ImportError as missing:
            if missing.name != "sitecustomize":
                raise
    except Exception as error:  # noqa: BLE001 (as site.execsitecustomize: reported, not fatal)
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(error).__name__}: {error}",
              file=sys.stderr)
    finally:
        sys.path.insert(0, first)


def module_file(entry: str, names: set[str], name: str) -> str | None:
    """The file that `import name` finds in the sys.path entry `entry` (listed as `names`)."""
    if name in names and os.path.isfile(init := os.path.join(entry, name, "__init__.py")):
        return init
    if f"{name}.py" in names:
        return os.path.join(entry, f"{name}.py")
    extension = next((file for file in names if file.startswith(f"{name}.") and file.endswith(".so")), None)
    return os.path.join(entry, extension) if extension else None


def installed_origin(name: str) -> str | None:
    """Where `import name` finds it with the installation's folders alone (and the import hooks of
    editable installs)."""
    spec = importlib.machinery.PathFinder.find_spec(name, INSTALLATION_PATH)
    for finder in sys.meta_path:
        if spec is None and finder is not importlib.machinery.PathFinder and hasattr(finder, "find_spec"):
            try:
                spec = finder.find_spec(name, None)
            except Exception:  # noqa: BLE001 (a finder that cannot answer finds nothing)
                spec = None
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else None


# The installation's folders: what follows sys.path[0] and PYTHONPATH's entries.
INSTALLATION_PATH = sys.path[1 + len(python_path(dict(os.environ))):]
# The file of each top-level module imported here (filled in by main), and those of them that the
# installation alone finds at the same file: a request finds the others on its own sys.path or not at all.
TOP_LEVEL: dict[str, str] = {}
FOUND_BY_INSTALLATION: set[str] = set()


def become(request: dict, fds: list[int], connection: socket.socket) -> None:
    """Turn this fork into the requested interpreter and run it to its exit."""
    connection.close()
    die_with_parent(signal.SIGKILL)
    os.setsid()
    place_descriptors(fds, [0, 1, 2, *request["descriptors"]])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name, limits in request["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limits))
    os.environ.clear()
    os.environ.update(request["env"])
    set_again_from_environment()
    for number, handler in FRESH_SIGNALS.items():
        signal.signal(number, handler)
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin, sys.stdout, sys.stderr = (standard_stream(0, unbuffered), standard_stream(1, unbuffered),
                                         standard_stream(2, unbuffered))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.executable = request["executable"]  # the processes it starts ask this server too
    if "multiprocessing.spawn" in sys.modules:  # and multiprocessing's servers, as it reads sys.executable at import
        sys.modules["multiprocessing.spawn"].set_executable(sys.executable)
    sys.path[:] = [first_entry(request), *python_path(os.environ), *INSTALLATION_PATH]
    tempfile.tempdir = None  # found again from TMPDIR
    kind, target = request["main"]
    sys.argv = [{"module": "-m", "code": "-c"}.get(kind, target), *request["args"]]
    finish(run_main(kind, target))


def set_again_from_environment() -> None:
    """What SET_AGAIN's variables set when their module was imported here, set as that import
    would from the fork's environment: inductor's compile threads."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = config.decide_compile_threads()


def place_descriptors(fds: list[int], numbers: list[int]) -> None:
    """Each descriptor received at the number it had in the client (inheritable, as it was there).
    They are first moved past every number involved, so that placing one never closes another."""
    past = max([*fds, *numbers]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, past) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, number in zip(moved, numbers):
        os.dup2(fd, number)
        os.close(fd)


def standard_stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """sys.stdin, stdout or stderr as a fresh interpreter opens them (-u: written through)."""
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8",
                            errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=not unbuffered and (fd == 2 or raw.isatty()), write_through=unbuffered)


def run_main(kind: str, target: str) -> int:
    """Run the module or script as __main__; the exit code a fresh interpreter would give."""
    sys.modules["__main__"] = types.ModuleType("__main__")
    if kind == "module":  # imported by this server: run it once, as a fresh interpreter does
        module = sys.modules.get(target)
        sys.modules.pop(f"{target}.__main__" if hasattr(module, "__path__") else target, None)
    try:
        run_sitecustomize()  # what the interpreter's start imports (refusal: only a declared one)
        if kind == "module":
            runpy._run_module_as_main(target)  # what `python -m` runs
        elif kind == "code":  # what `python -c` runs: the code in __main__, named <string>
            main = sys.modules["__main__"]
            main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter)
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT  # Python ends by the signal
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def finish(code: int) -> None:
    try:
        threading._shutdown()  # noqa: SLF001 (what the interpreter does at exit: join non-daemon threads)
        atexit._run_exitfuncs()  # noqa: SLF001
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
