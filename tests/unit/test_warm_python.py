"""The suite's warm Python (tests/warm_python): a process forked by a server is the interpreter
the command line asks for (arguments, directory, environment, descriptors, limits, exit code or
signal, signals passed in, a module run once), and whatever a fork could not reproduce is started
as a real interpreter."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.warm_python import REAL_PYTHON, start_servers, write_client
from tests.warm_python.client import running
from tests.warm_python.server import ORDER_INDEPENDENT, READ_AT_START, VECTOR_ISA_FOLDER, read_at_start

# Imported by the servers only: a process that has it in sys.modules at its start is a fork.
PRELOADED = "xml.dom.minidom"
# Run by the tests: it says what it is, then does what its arguments ask.
PROBE = """
import os, signal, sys, time
print(repr(("forked" if "xml.dom.minidom" in sys.modules else "real", os.getcwd(), os.environ.get("PROBE_VALUE"),
           sys.argv[1:], hash("a string"))), flush=True)
print("to stderr", file=sys.stderr)
print("signals", [signal.getsignal(number) for number in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ,
                                                          signal.SIGTERM, signal.SIGCHLD)])
action = sys.argv[1] if len(sys.argv) > 1 else ""
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "signal":
    os.kill(os.getpid(), int(sys.argv[2]))
if action == "raise":
    raise ValueError("a mistake")
if action == "stdin":
    print("read", sys.stdin.read().strip())
if action == "frozen":
    import gc
    print("frozen", gc.get_freeze_count())
if action == "limit":
    import resource
    print("files", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
if action == "burn":  # CPU seconds here and in a child it waits for
    def burn(seconds):
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass
    child = os.fork()
    if child == 0:
        burn(float(sys.argv[2]))
        os._exit(0)
    burn(float(sys.argv[2]))
    os.waitpid(child, 0)
if action == "wait":
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
"""
# A module that records each execution of its body.
COUNTED = """
import os
with open(os.environ["COUNT_FILE"], "a") as f:
    f.write(__name__ + "\\n")
"""


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    folder, code = tmp_path_factory.mktemp("warm"), tmp_path_factory.mktemp("code")
    code_folder = code
    (code / "probe.py").write_text(PROBE)
    (code / "counted.py").write_text(COUNTED)
    env = {**os.environ, "PYTHONPATH": str(code), "COUNT_FILE": str(folder / "count"),
           "TEST_CPU_LOG": str(folder / "cpu.jsonl")}
    # multiprocessing imported before they fork, as the suite's servers have (torch imports it).
    servers = start_servers(folder, [PRELOADED, "counted", "multiprocessing.forkserver"], 2, env,
                            folder / "servers.log")
    deadline = time.time() + 60
    while not all((folder / f"slot-{slot}.sock").exists() for slot in range(2)):
        assert time.time() < deadline and all(s.poll() is None for s in servers), (folder / "servers.log").read_text()
        time.sleep(0.05)

    class Warm:
        client = str(write_client(folder))
        code = code_folder
        log = folder / "servers.log"
        cpu_log = folder / "cpu.jsonl"

        def env(self, **extra):
            return {**env, "TEST_WARM_PYTHON": str(folder), "TEST_WARM_PYTHON_SLOTS": "2", **extra}

        def run(self, *args, env=None, **kwargs):
            return subprocess.run([self.client, *args], env=env or self.env(), capture_output=True, text=True,
                                  timeout=60, **kwargs)

    yield Warm()
    for server in servers:
        server.terminate()
        server.wait()


def test_a_module_runs_forked_with_its_arguments_directory_environment_and_streams(warm, tmp_path):
    result = warm.run("-m", "probe", "plain", "--flag", cwd=tmp_path, env=warm.env(PROBE_VALUE="x"))
    assert result.returncode == 0, result.stderr
    assert said(result)[:4] == ("forked", str(tmp_path), "x", ["plain", "--flag"])
    assert result.stderr == "to stderr\n"
    # The fork's signal dispositions are a fresh interpreter's.
    real = subprocess.run([REAL_PYTHON, "-m", "probe"], cwd=tmp_path, env=warm.env(), capture_output=True, text=True,
                          timeout=60)
    assert said(real)[0] == "real" and real.stdout.splitlines()[1] == result.stdout.splitlines()[1]
    script = warm.run("-u", str(warm.code / "probe.py"), "plain")
    assert said(script)[0] == "forked", script


def test_a_fork_starts_with_the_servers_imports_out_of_the_collectors_sight(warm, tmp_path):
    """gc.freeze before serving: a fork's full collections walk only what the fork made."""
    forked = warm.run("-m", "probe", "frozen", cwd=tmp_path)
    assert said(forked)[0] == "forked", forked.stderr
    frozen = int(forked.stdout.split("frozen ")[1].split()[0])
    assert frozen > 1000  # the stdlib modules the server imported, at least
    real = subprocess.run([REAL_PYTHON, "-m", "probe", "frozen"], cwd=tmp_path, env=warm.env(), capture_output=True,
                          text=True, timeout=60)
    assert said(real)[0] == "real" and "frozen 0" in real.stdout


def test_a_forks_cpu_and_its_childrens_are_logged_with_the_test_that_started_it(warm):
    """TEST_CPU_LOG: the forks run outside the tests' process tree, so the server counts them."""
    test = "tests/unit/test_warm_python.py::a_test[with (a) parameter]"
    result = warm.run("-m", "probe", "burn", "0.3", env=warm.env(PYTEST_CURRENT_TEST=f"{test} (call)"))
    assert said(result)[0] == "forked", result.stderr
    lines = [json.loads(line) for line in warm.cpu_log.read_text().splitlines()]
    (burnt,) = [line for line in lines if line["test"] == test]
    assert burnt["fork"] == "module probe"
    assert 0.6 <= burnt["cpu"] < 1.5  # 0.3 s in the fork and 0.3 s in its child


def test_exit_codes_exceptions_and_deaths_by_signal_are_the_processs(warm):
    assert warm.run("-m", "probe", "exit", "3").returncode == 3
    raised = warm.run("-m", "probe", "raise")
    assert raised.returncode == 1 and raised.stderr.strip().endswith("ValueError: a mistake"), raised.stderr
    for number in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: a signal that has no handler to reset
        assert warm.run("-m", "probe", "signal", str(int(number))).returncode == -number


def test_stdin_and_resource_limits_reach_the_process(warm):
    assert "read hello" in warm.run("-m", "probe", "stdin", input="hello\n").stdout
    limited = subprocess.run(["bash", "-c", f"ulimit -n 100 && exec {warm.client} -m probe limit"], env=warm.env(),
                             capture_output=True, text=True, timeout=60)
    assert said(limited)[0] == "forked" and "files 100" in limited.stdout, limited


def test_signals_to_the_client_reach_the_process_and_its_death_takes_the_process(warm, tmp_path):
    pid_file = tmp_path / "pid"
    client = subprocess.Popen([warm.client, "-m", "probe", "wait", str(pid_file)], env=warm.env(),
                              stdout=subprocess.PIPE, text=True)
    wait_for(pid_file.exists)
    client.send_signal(signal.SIGUSR1)
    assert client.wait(timeout=30) == 7
    pid_file.unlink()
    client = subprocess.Popen([warm.client, "-m", "probe", "wait", str(pid_file)], env=warm.env(),
                              stdout=subprocess.PIPE, text=True)
    wait_for(lambda: pid_file.exists() and pid_file.read_text())
    process = int(pid_file.read_text())
    client.kill()
    client.wait()
    wait_for(lambda: not running(process))


def test_the_module_runs_once_as_main_as_in_a_fresh_interpreter(warm, tmp_path):
    count = tmp_path / "count"
    assert warm.run("-m", "counted", env=warm.env(COUNT_FILE=str(count))).returncode == 0
    assert count.read_text() == "__main__\n"


def test_ranks_in_different_slots_have_different_hash_seeds(warm):
    hashes = [said(warm.run("-m", "probe", env=warm.env(RANK=str(rank))))[4] for rank in (0, 1, 2)]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]  # 2 slots: ranks 0 and 2 share one


@pytest.mark.parametrize("change, reason", [
    ({"TORCH_LOGS": "+dynamo"}, "TORCH_LOGS differs"),
    ({"PYTHONHASHSEED": "0"}, "PYTHONHASHSEED differs"),
    ({"OMP_NUM_THREADS": "7"}, "OMP_NUM_THREADS differs"),
])
def test_what_a_fork_could_not_reproduce_runs_in_a_real_interpreter(warm, change, reason):
    result = warm.run("-m", "probe", env=warm.env(**change))
    assert result.returncode == 0 and said(result)[0] == "real", result
    assert reason in warm.log.read_text()


def test_a_packages_settings_are_a_forks_own_unless_the_server_imported_the_package(warm):
    """W&B's and Hugging Face's settings are read when their packages are imported, which the
    servers have not done (the suite's import torch and the trainer): the fork reads them itself."""
    result = warm.run("-m", "probe", env=warm.env(WANDB_MODE="offline", HF_HUB_OFFLINE="1"))
    assert result.returncode == 0 and said(result)[0] == "forked", result
    assert "WANDB" not in read_at_start({"torch", "trainer"})
    assert "WANDB" in read_at_start({"torch", "wandb"}) and "HF_" in read_at_start({"datasets"})
    assert read_at_start(set()) == READ_AT_START


@pytest.mark.parametrize("file, reason", [("sitecustomize.py", "holds a sitecustomize"),
                                          ("counted.py", "counted would be")])
def test_a_pythonpath_that_changes_an_import_runs_in_a_real_interpreter(warm, tmp_path, file, reason):
    """A folder ahead on PYTHONPATH that the interpreter's start imports from, or that holds a module of
    the server's own; a folder that changes nothing is served."""
    (tmp_path / "empty").mkdir()
    served = warm.run("-m", "probe", env=warm.env(PYTHONPATH=f"{tmp_path / 'empty'}:{warm.code}"))
    assert said(served)[0] == "forked", served
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / file).write_text("")
    result = warm.run("-m", "probe", env=warm.env(PYTHONPATH=f"{tmp_path / 'hook'}:{warm.code}"))
    assert said(result)[0] == "real", result
    assert reason in warm.log.read_text()


# A sitecustomize that sets what the probe prints, and one that fails part-way.
HOOK = f"{ORDER_INDEPENDENT}\nimport os\nos.environ['PROBE_VALUE'] = 'set by the hook'\n"
FAILING_HOOK = f"{ORDER_INDEPENDENT}\nraise ValueError('a broken hook')\n"


@pytest.mark.parametrize("hook", [HOOK, FAILING_HOOK])
def test_a_sitecustomize_declared_order_independent_runs_in_the_fork_as_at_an_interpreters_start(warm, tmp_path,
                                                                                                  hook):
    """Imported before the module, from PYTHONPATH and not from the working directory, a failure
    reported and the start going on: what the real interpreter does with the same file."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(hook)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "sitecustomize.py").write_text("raise SystemExit('not searched at the start')")
    env = warm.env(PYTHONPATH=f"{tmp_path / 'hook'}:{warm.code}")
    forked = warm.run("-m", "probe", cwd=tmp_path / "cwd", env=env)
    real = warm.run("-m", "probe", cwd=tmp_path / "cwd", env={**env, "TEST_WARM_PYTHON": ""})
    assert said(forked)[0] == "forked" and said(real)[0] == "real", (forked, real)
    assert said(forked)[2] == said(real)[2] == ("set by the hook" if hook == HOOK else None)
    assert forked.returncode == real.returncode == 0 and forked.stderr == real.stderr, (forked.stderr, real.stderr)
    assert ("Error in sitecustomize" in forked.stderr) == (hook == FAILING_HOOK)


def test_switched_off_the_interpreter_is_real(warm):
    assert warm.run("-m", "probe", env=warm.env(TEST_WARM_PYTHON="")).stdout.startswith("('real',")


# Code run with -c as multiprocessing's fork server is: what it was started as, with what arguments,
# and what it reads from the descriptor its first argument names.
CODE = ("from multiprocessing.forkserver import main; import os, sys; print('xml.dom.minidom' in sys.modules, "
        "sys.argv, sys.path[0] == '', os.read(int(sys.argv[1]), 5))")
# A multiprocessing fork server started by a fork: itself a fork (multiprocessing starts it with
# `sys.executable -c ...` and the descriptors it passes).
FORK_SERVER = """
import multiprocessing, sys
def preloaded():
    return "xml.dom.minidom" in sys.modules
if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        print("fork server's child preloaded:", pool.apply(preloaded))
"""


def test_multiprocessings_servers_run_forked_with_their_inherited_descriptors(warm, tmp_path):
    read, write = os.pipe()
    os.write(write, b"hello")
    os.close(write)
    try:
        result = subprocess.run([warm.client, "-c", CODE, str(read)], env=warm.env(), capture_output=True, text=True,
                                timeout=60, pass_fds=[read])
    finally:
        os.close(read)
    assert result.stdout == f"True ['-c', '{read}'] True b'hello'\n", result
    (tmp_path / "server_started.py").write_text(FORK_SERVER)
    started = warm.run(str(tmp_path / "server_started.py"))
    assert started.stdout == "fork server's child preloaded: True\n", started


def test_other_command_lines_and_a_shadowing_folder_run_in_a_real_interpreter(warm, tmp_path):
    assert warm.run("-c", "import sys; print('xml.dom.minidom' in sys.modules)").stdout == "False\n"
    (tmp_path / "counted.py").write_text("")  # a module of the server's, shadowed by the working directory
    assert warm.run("-m", "probe", cwd=tmp_path).stdout.startswith("('real',")


def said(result: subprocess.CompletedProcess) -> tuple:
    """What the probe printed first: (forked or real, directory, PROBE_VALUE, arguments, a hash)."""
    return ast.literal_eval(result.stdout.splitlines()[0])


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline
        time.sleep(0.02)


ISA_PROBE = """
import json
from torch._inductor import cpu_vec_isa
made = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
print(json.dumps([made, [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]]))
"""


@contextlib.contextmanager
def servers_with_torch(tmp_path: Path):
    """This session's servers (they have imported torch), or one started here when the warm Python
    is off: their folder."""
    folder = Path(os.environ.get("TEST_WARM_PYTHON") or "")
    servers = []
    if not folder.is_dir():
        folder = tmp_path / "warm"
        folder.mkdir()
        servers = start_servers(folder, ["torch", "torch._inductor.config"], 1, dict(os.environ),
                                folder / "servers.log")
        write_client(folder)
    try:
        yield folder
    finally:
        for process in servers:
            process.terminate()


def test_a_fork_finds_the_vector_instruction_check_made_as_a_fresh_interpreter_makes_it(tmp_path):
    """The servers make inductor's check of the CPU's vector instructions once (a g++ build per
    instruction set, 7 s of CPU): a fork that compiles finds it made, with the result a fresh
    interpreter finds."""
    with servers_with_torch(tmp_path) as folder:
        (tmp_path / "isa_probe.py").write_text(ISA_PROBE)
        env = {**os.environ, "TEST_WARM_PYTHON": str(folder), "TEST_WARM_PYTHON_SLOTS": "1",
               "PYTHONPATH": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(folder / VECTOR_ISA_FOLDER)}
        # The client waits for a server that is starting, and the fork for its vector check.
        forked = subprocess.run([str(folder / "python"), "-m", "isa_probe"], env=env, capture_output=True, text=True,
                                timeout=120)
        fresh = subprocess.run([REAL_PYTHON, "-m", "isa_probe"], env=env, capture_output=True, text=True, timeout=120)
    made_in_fork, isa_in_fork = json.loads(forked.stdout)
    made_fresh, isa_fresh = json.loads(fresh.stdout)
    assert (made_in_fork, made_fresh) == (1, 0)
    assert isa_in_fork == isa_fresh


THREADS_PROBE = """
import torch._inductor.config as config
print(config.compile_threads)
"""


def test_inductors_compile_threads_follow_the_forks_environment(tmp_path):
    """TORCHINDUCTOR_COMPILE_THREADS is read when inductor's config is imported, in the server
    before the fork: the fork sets it again from its own, as a fresh interpreter's import does."""
    threads = "3"  # the servers have 1 (tests/conftest.py)
    with servers_with_torch(tmp_path) as folder:
        (tmp_path / "threads_probe.py").write_text(THREADS_PROBE)
        env = {**os.environ, "TEST_WARM_PYTHON": str(folder), "TEST_WARM_PYTHON_SLOTS": "1",
               "PYTHONPATH": str(tmp_path), "TORCHINDUCTOR_COMPILE_THREADS": threads}
        forked = subprocess.run([str(folder / "python"), "-m", "threads_probe"], env=env, capture_output=True,
                                text=True, timeout=120)
        fresh = subprocess.run([REAL_PYTHON, "-m", "threads_probe"], env=env, capture_output=True, text=True,
                               timeout=120)
        log = Path(os.environ.get("TEST_WARM_PYTHON_LOG") or folder / "servers.log")
        refused = log.exists() and "refused module threads_probe" in log.read_text()
    assert forked.stdout == fresh.stdout == f"{threads}\n", (forked, fresh)
    assert not refused  # the fork ran it


@pytest.mark.parametrize("starts", ["slowly", "and fails"])
def test_a_client_waits_for_a_server_that_is_importing_and_not_for_one_that_failed(tmp_path, starts):
    """A request that comes while its server still imports is served once the server is ready
    (the suite's first launches come within its import); a server that ended before it was ready
    sends the client to the real interpreter at once."""
    folder, code = tmp_path / "warm", tmp_path / "code"
    folder.mkdir()
    code.mkdir()
    (code / "probe.py").write_text(PROBE)
    (code / "importing.py").write_text("import time\ntime.sleep(3)\n" if starts == "slowly" else
                                       "raise SystemExit('this server does not start')\n")
    env = {**os.environ, "PYTHONPATH": str(code)}
    servers = start_servers(folder, [PRELOADED, "importing"], 1, env, folder / "servers.log")
    try:
        client = write_client(folder)
        if starts == "and fails":
            servers[0].wait(30)
        started = time.monotonic()
        result = subprocess.run([str(client), "-m", "probe"], env={**env, "TEST_WARM_PYTHON": str(folder)},
                                capture_output=True, text=True, timeout=60)
        waited = time.monotonic() - started
    finally:
        servers[0].terminate()
    assert said(result)[0] == ("forked" if starts == "slowly" else "real"), result
    assert waited < 10, waited
