"""How a process that ran gloo collectives ends: `trainer.launch.process_exit.run_process` keeps the entry
point's exit code and output, and no gloo worker thread can crash the process after a successful run;
its error is reported to the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from tests.launch import REPO
from trainer.process_setup import _free_port

# Two processes set up the exit race deterministically on rank 0:
# 1. rank 0 starts an asynchronous all-reduce and drops its tensor and handle at once; rank 1
#    joins it a little later, so the collective finishes after that and the gloo worker thread
#    holds the last reference, which it must take the GIL to release;
# 2. rank 0's main thread holds the GIL until the collective has finished (a switch interval of
#    100 s keeps the worker from asking for it), so the worker is left waiting for the GIL;
# 3. an object whose finalizer sleeps releases the GIL once interpreter teardown has begun: the
#    waiting worker thread wakes up in a finalizing interpreter.
# On a real run, step 2 is the scheduler not running the worker thread until the main thread
# has passed destroy_process_group().
EXIT_RACE = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from trainer import process_setup
    from trainer.launch.process_exit import run_process

    class ReleasesTheGilInTeardown:
        def __del__(self, sleep=time.sleep):  # bound now: module globals may be gone by then
            sleep(0.2)

    releaser = ReleasesTheGilInTeardown()
    process_setup.init_distributed(torch.device("cpu"), timeout_s=60)
    dist.barrier()
    sys.setswitchinterval(100)
    if dist.get_rank() == 1:
        time.sleep(0.1)
    tensor = torch.ones(4)
    handle = dist.all_reduce(tensor, async_op=True)
    del tensor, handle
    sum(range(5 * 10**7))  # pure C: keeps the GIL while the all-reduce finishes
    # Nothing that releases the GIL (printing does) until the process ends.
    if sys.argv[1] == "run_process":
        run_process(lambda: 0)
    sys.exit(0)
""")


def python_env(**ranks: str) -> dict[str, str]:
    """This environment with the distributed variables given here and no others (none: a world of one),
    and Python's own output buffering."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED",
                 "TORCHELASTIC_ERROR_FILE"):
        env.pop(name, None)
    return {**env, **ranks}


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=python_env(), capture_output=True,
                          text=True, timeout=120)


def run_two_ranks(code: str, *args: str) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of ranks 0 and 1 of a gloo world of two."""
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=python_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    return [(rank.returncode, out, err) for rank, (out, err) in zip(ranks, outputs)]


def test_run_process_ends_cleanly_where_interpreter_teardown_crashes():
    # The control: with Python's own exit, rank 0's gloo worker thread aborts the process.
    code, _, err = run_two_ranks(EXIT_RACE, "sys_exit")[0]
    assert code == -signal.SIGABRT, (
        f"the race no longer crashes a plain exit (exit {code}): check whether this torch/Python still needs "
        f"trainer.launch.process_exit.exit_without_teardown\n{err[-2000:]}")
    assert "terminate called without an active exception" in err

    for code, _, err in run_two_ranks(EXIT_RACE, "run_process"):
        assert code == 0 and "terminate called" not in err, err[-2000:]


def test_run_process_keeps_exit_codes_and_flushes_output():
    script = textwrap.dedent("""
        import logging, sys
        from trainer.launch.process_exit import run_process
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)

        def entry():
            print("buffered line")  # stdout is a pipe: block-buffered until flushed
            logging.getLogger("t").info("logged line")
            outcome = sys.argv[1]
            if outcome == "raise":
                raise RuntimeError("boom")
            if outcome == "message":
                sys.exit("usage: bad arguments")
            if outcome == "interrupt":
                raise KeyboardInterrupt
            return None if outcome == "none" else int(outcome)

        run_process(entry)
    """)
    expected = {"none": 0, "2": 2, "raise": 1, "message": 1, "interrupt": 130}
    results = {outcome: run_python(script, outcome) for outcome in expected}
    for outcome, code in expected.items():
        result = results[outcome]
        assert result.returncode == code, (outcome, result.returncode, result.stderr)
        assert "buffered line" in result.stdout and "logged line" in result.stderr, (outcome, result.stdout)
    assert "RuntimeError: boom" in results["raise"].stderr  # the traceback, as Python prints it
    assert "usage: bad arguments" in results["message"].stderr


def test_errors_are_reported_to_the_launcher(tmp_path):
    """Under an elastic agent (TORCHELASTIC_ERROR_FILE set), an escaping exception or exit message,
    and a user's mistake found by trainer.train, are written where the launcher reads them."""
    script = textwrap.dedent("""
        import sys
        from trainer.launch.process_exit import run_process

        def entry():
            outcome = sys.argv[1]
            if outcome == "raise":
                raise RuntimeError("boom")
            if outcome == "message":
                sys.exit("usage: bad arguments")
            return int(outcome)

        run_process(entry)
    """)
    reports = {}
    for outcome, code in {"raise": 1, "message": 1, "0": 0, "3": 3}.items():
        path = tmp_path / f"{outcome}.json"
        result = subprocess.run([sys.executable, "-c", script, outcome], cwd=REPO, capture_output=True, text=True,
                                env={**python_env(), "TORCHELASTIC_ERROR_FILE": str(path)}, timeout=120)
        assert result.returncode == code, result.stderr
        reports[outcome] = json.loads(path.read_text()) if path.exists() else None
    assert reports["raise"]["trainer"]["message"] == "RuntimeError: boom"
    assert reports["raise"]["trainer"]["exit_code"] == 1
    assert "Traceback (most recent call last)" in reports["raise"]["message"]["extraInfo"]["py_callstack"]
    assert reports["message"]["trainer"]["message"] == "usage: bad arguments"
    assert reports["0"] is None and reports["3"] is None  # an exit code alone: the entry point reports its errors

    path = tmp_path / "train.json"
    result = subprocess.run([sys.executable, "-m", "trainer.train", "--training.stpes", "5"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**python_env(), "TORCHELASTIC_ERROR_FILE": str(path)})
    assert result.returncode == 2
    report = json.loads(path.read_text())["trainer"]
    assert report["exit_code"] == 2 and "unknown key training.stpes; did you mean 'steps'?" in report["message"]
