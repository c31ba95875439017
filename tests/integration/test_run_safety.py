"""A job and its dump folder: ranks die with their launcher, one live job per dump folder, automatic
restarts from the latest checkpoint after a rank is killed (after a rank hangs:
tests/integration/test_timeouts.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import LAUNCHER, REPO, TINY_JOB, descendants, describe, launch, read_metrics
from trainer.launch import run_lock

# Real processes (tests/warm_python): launchers and ranks are killed and watched. The deadlines
# here leave room for tests beside them (ranks gone 3 s after their launcher: 0.1 s measured; a
# second job refused within 10 s: 0.4 s). A stopped rank's 5 s train timeout, which a slow healthy
# step must not reach, is tested `alone` in tests/integration/test_timeouts.py.
pytestmark = pytest.mark.real_processes

# A job that lives while a test acts on it: it waits 50 ms after each step (debug.step_delay_s), so
# it leaves the cores to what the test starts beside it.
LONG_JOB = [*TINY_JOB, "--training.steps", "10000", "--debug.step_delay_s", "0.05"]


def start(nproc: int, args: list[str], **env: str) -> subprocess.Popen:
    """The launcher in a process group of its own (as a shell or a scheduler would start it)."""
    full_env = dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable, LOG_RANK="0", CUDA_VISIBLE_DEVICES="",
                    **env)
    return subprocess.Popen([str(LAUNCHER), *args], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, folder: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        path = folder / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        if any(json.loads(line)["step"] >= step for line in lines if line.endswith("}")):
            return
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not reaped by its parent, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_ranks_die_with_their_launcher_which_holds_the_dump_folder(tmp_path, measured):
    """The launcher is killed with SIGKILL with its process group (a shell's job, a wrapper, the
    out-of-memory killer): its ranks, in sessions of their own, must not train on. While it
    lives, a second job into its dump folder is refused; once it is gone, its lock is taken over."""
    proc = start(2, [*LONG_JOB, "--job.dump_folder", str(tmp_path)])
    try:
        wait_for_step(proc, tmp_path, 1)
        started = time.perf_counter()
        second = launch(1, [*TINY_JOB, "--training.steps", "1", "--job.dump_folder", str(tmp_path)])
        refused_s = time.perf_counter() - started
        assert second.returncode == 2, describe(second)
        assert (f"error: job.dump_folder {tmp_path}: another job (PID {proc.pid} on {socket.gethostname()}"
                in second.stderr), describe(second)
        assert "logs:" not in second.stdout and refused_s < 10

        ranks = descendants(proc.pid)
        assert len(ranks) >= 2, ranks
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: not the ranks' own sessions
        killed = time.perf_counter()
        while any(alive(pid) for pid in ranks) and time.perf_counter() - killed < 3:
            time.sleep(0.01)
        gone_s = time.perf_counter() - killed
        survivors = [pid for pid in ranks if alive(pid)]
    finally:
        stop(proc)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived their launcher by 3 s"
    measured(f"launcher killed with SIGKILL: its {len(ranks)} processes gone after {gone_s:.2f} s; a second job "
             f"into its dump folder refused in {refused_s:.1f} s")

    after = launch(1, [*TINY_JOB, "--training.steps", "1", "--job.dump_folder", str(tmp_path)])
    assert after.returncode == 0, describe(after)
    assert f"note: took over the lock {tmp_path / '.lock'} of a job that is gone (PID {proc.pid} on" in after.stdout
    assert not (tmp_path / ".lock").exists()


WATCHED = """
import sys, time
from trainer.launch import launcher_watch
if sys.argv[1] == "thread":
    launcher_watch.parent_death_signal = lambda sig: False  # as on a system without prctl
print(launcher_watch.watch_launcher(), flush=True)
time.sleep(60)
"""
MIDDLE = """
import os, subprocess, sys, time

os.environ["TRAINER_LAUNCHER_PID"] = str(os.getpid())
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["kernel", "thread"])
@pytest.mark.smoke
def test_the_launcher_watch_without_torch(how, measured):
    """The rank's side alone: through the kernel's parent-death signal, and through the polling
    thread of systems without it."""
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHED, how], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid, watched_by = middle.stdout.readline().split()
        assert watched_by == how
        middle.kill()
        killed = time.perf_counter()
        while alive(int(pid)) and time.perf_counter() - killed < 3:
            time.sleep(0.01)
        assert not alive(int(pid))
        measured(f"launcher watch by {how}: the rank died {time.perf_counter() - killed:.2f} s after its launcher")
    finally:
        middle.kill()
        middle.wait()
    # The launcher died before the rank asked for the signal: the rank sees it is not its parent.
    gone = subprocess.Popen(["true"])
    gone.wait()
    late = subprocess.run([sys.executable, "-c", WATCHED, how], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, TRAINER_LAUNCHER_PID=str(gone.pid)), timeout=60)
    assert late.returncode == -signal.SIGKILL and late.stdout == ""


# ---------------------------------------------------------------------------------------------
# One live job per dump folder


@pytest.mark.smoke
def test_the_lock_of_a_live_process_is_refused_a_gone_one_taken_over(tmp_path):
    lock = run_lock.take(tmp_path)
    holder = json.loads((tmp_path / ".lock").read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid()) and lock.note is None
    with pytest.raises(run_lock.LockRefused, match=f"another job \\(PID {os.getpid()} on {socket.gethostname()}"):
        run_lock.take(tmp_path)  # held: flock
    lock.release()
    assert not (tmp_path / ".lock").exists()

    gone = subprocess.Popen(["true"])
    gone.wait()
    cases = {"dead PID": {"pid": gone.pid, "start_ticks": 1},
             "PID reused by another process": {"pid": os.getpid(), "start_ticks": -1}}
    for holder in cases.values():
        (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), **holder}))
        lock = run_lock.take(tmp_path)
        assert lock.note.startswith(f"took over the lock {tmp_path / '.lock'} of a job that is gone (PID "
                                    f"{holder['pid']} on {socket.gethostname()}"), lock.note
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        lock.release()

    # Without flock (a filesystem without it): the PID and its start time decide.
    live = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": run_lock.process_start_ticks(os.getpid())}
    (tmp_path / ".lock").write_text(json.dumps(live))
    with pytest.raises(run_lock.LockRefused, match="holds it"):
        run_lock.take(tmp_path)
    # Another machine's lock cannot be checked: refused, with how to remove it.
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "2026-01-05T14:22:10"}))
    with pytest.raises(run_lock.LockRefused, match=f"PID 4242 on node-7 .*remove {tmp_path / '.lock'}"):
        run_lock.take(tmp_path)


def test_every_entry_point_that_writes_a_run_folder_is_refused_while_a_job_holds_it(tmp_path, measured):
    """A live job holds its dump folder and its checkpoint folder. Whatever else would write into
    them is refused with the holder's host and PID: the trainer started directly (one process, or
    two through torchrun without the launcher), a seed checkpoint, and a run of another dump
    folder that names the live job's checkpoint folder (an absolute checkpoint.folder). The live
    job's curve is untouched."""
    run = tmp_path / "run"
    proc = start(1, [*LONG_JOB, "--checkpoint.enable", "--checkpoint.interval", "5", "--job.dump_folder", str(run)])
    trainer = [sys.executable, "-m", "trainer.train", *TINY_JOB, "--training.steps", "20"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "trainer.train", *TINY_JOB, "--training.steps", "20"]
    attempts = {
        "python -m trainer.train": (trainer + ["--checkpoint.enable", "--job.dump_folder", str(run)], "job.dump_folder", run),
        "torchrun, 2 ranks": (torchrun + ["--job.dump_folder", str(run)], "job.dump_folder", run),
        "seed checkpoint": (trainer + ["--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(run)],
                            "job.dump_folder", run),
        "shared checkpoint.folder": (trainer + ["--checkpoint.enable", "--job.dump_folder", str(tmp_path / "other"),
                                                "--checkpoint.folder", str(run / "checkpoint")],
                                     "checkpoint.folder", run / "checkpoint"),
    }
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    try:
        wait_for_step(proc, run, 6)  # its step-5 checkpoint is there to be resumed, as in the reported failure
        started = time.perf_counter()
        # Side by side: each is refused before it writes anything.
        pending = {name: subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True) for name, (argv, _, _) in attempts.items()}
        results = {name: (p.communicate(timeout=180)[0], p.returncode) for name, p in pending.items()}
        refused_s = time.perf_counter() - started
        assert proc.poll() is None, "the live job ended"
    finally:
        stop(proc)
    for name, (output, code) in results.items():
        _, key, folder = attempts[name]
        assert code != 0, f"{name}: not refused\n{output}"
        assert (f"{key} {folder}: another job (PID {proc.pid} on {socket.gethostname()}" in output), f"{name}\n{output}"
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(1, len(steps) + 1)), "the live job's curve was changed"
    assert not (tmp_path / "other" / "metrics.jsonl").exists() and not (run / "checkpoint" / "step-0").exists()
    measured(f"a live job's folders: {len(attempts)} direct writers refused side by side in {refused_s:.1f} s")


# ---------------------------------------------------------------------------------------------
# Automatic restarts


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The process of the current attempt's rank `rank` (from its environment, /proc)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(v.startswith(b"TORCHELASTIC_ERROR_FILE=") for v in environ):
            return pid
    raise AssertionError(f"no rank {rank} below {launcher_pid}")


# 30 steps of about 0.1 s: a rank killed at step 5 is killed well before the end.
RESTART_JOB = [*TINY_JOB, "--training.steps", "30", "--checkpoint.enable", "--checkpoint.interval", "3"]


def run_with_signal(tmp_path: Path, args: list[str], sig: signal.Signals, at_step: int) -> tuple:
    """The job in tmp_path/run, `sig` sent to rank 1 once step `at_step` is logged; (its
    CompletedProcess, every process it started)."""
    proc = start(2, [*args, "--job.dump_folder", str(tmp_path / "run")])
    seen: set[int] = set()
    try:
        wait_for_step(proc, tmp_path / "run", at_step)
        os.kill(rank_pid(proc.pid, 1), sig)
        while proc.poll() is None:  # every process of every attempt, to check none is left
            seen.update(descendants(proc.pid))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def assert_same_steps(run: Path, reference: Path, steps: int) -> None:
    """Each step once, with the loss and gradient norm of the uninterrupted run to the bit."""
    got, want = read_metrics(run), read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]


def test_a_killed_rank_restarts_the_job_from_the_latest_checkpoint(tmp_path, measured):
    reference = launch(2, [*RESTART_JOB, "--job.dump_folder", str(tmp_path / "reference")])
    assert reference.returncode == 0, describe(reference)
    started = time.perf_counter()
    result, _ = run_with_signal(tmp_path, RESTART_JOB, signal.SIGKILL, at_step=5)
    measured(f"rank 1 killed at step 5 of 30: restarted and finished in {time.perf_counter() - started:.1f} s")
    assert result.returncode == 0, describe(result)
    assert ("rank 1 died (killed by SIGKILL); restart 1 of 3 from the latest checkpoint" in result.stderr), \
        describe(result)
    assert_same_steps(tmp_path / "run", tmp_path / "reference", 30)
    record = json.loads((tmp_path / "run" / "run_meta.json").read_text())
    assert record["status"] == "completed" and record["restart"] == 1
    assert [start["restart"] for start in record["history"]] == [0]
    assert record["start"]["kind"] == "resume" and record["start"]["step"] % 3 == 0 < record["start"]["step"]


def test_a_trainer_started_without_the_launcher_refuses_a_linked_record(tmp_path):
    """run_meta.json a link to another file: the trainer started directly refuses it before it
    builds anything, as the launcher does (not moved aside as an old run's record), and the
    link's target is untouched."""
    run, target = tmp_path / "run", tmp_path / "target.json"
    run.mkdir()
    target.write_text("someone's file\n")
    (run / "run_meta.json").symlink_to(target)
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "trainer.train", *TINY_JOB, "--training.steps", "2",
                             "--job.dump_folder", str(run)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{run / 'run_meta.json'} is a symbolic link" in result.stdout + result.stderr, result.stdout
    assert (run / "run_meta.json").is_symlink() and target.read_text() == "someone's file\n"
    assert not (run / "previous").exists() and not (run / "metrics.jsonl").exists()
