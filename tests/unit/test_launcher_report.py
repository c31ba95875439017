"""The launcher's report of a failed run: which rank failed first, its message and the exit code."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from trainer.launch.failure_report import Hang, short_reason
from trainer.launch.launcher import (
    Options,
    RankFailure,
    UsageError,
    describe,
    hub_datasets,
    hub_unreachable,
    parse_options,
    restarts_for,
    root_cause,
)

T = 1_800_000_000.0  # a time stamp
PEER = ("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:65248: Connection reset by peer. "
        "This is typically caused by a remote worker hanging")


def test_a_killed_rank_is_the_cause_not_the_peer_that_lost_it():
    killed = RankFailure(rank=1, exitcode=-signal.SIGKILL, time=T)  # noticed late, whole seconds
    lost = RankFailure(rank=0, exitcode=1, time=T - 0.5, message=PEER)
    assert root_cause([lost, killed]) is killed
    # ... whatever the wording of the peer's error, while it is close in time.
    other = RankFailure(rank=0, exitcode=1, time=T - 0.5, message="RuntimeError: something else")
    assert root_cause([other, killed]) is killed


def test_ranks_stopped_by_the_agent_are_never_the_cause():
    error = RankFailure(rank=1, exitcode=2, time=T + 0.3, message="checkpoint.load_step=5: ...")
    stopped = RankFailure(rank=0, exitcode=-signal.SIGTERM, time=T)
    assert root_cause([stopped, error]) is error
    assert root_cause([stopped]) is stopped


def test_the_earliest_report_wins():
    first = RankFailure(rank=1, exitcode=2, time=T + 0.1, message="a")
    second = RankFailure(rank=0, exitcode=2, time=T + 0.2, message="a")
    assert root_cause([second, first]) is first
    # A kill long after the first error (the agent's SIGKILL of a rank that ignored SIGTERM) is a consequence.
    late_kill = RankFailure(rank=2, exitcode=-signal.SIGKILL, time=T + 31)
    assert root_cause([late_kill, second]) is second


def test_exit_codes_and_messages(tmp_path):
    assert describe(RankFailure(0, 2, T, "training.dataset: cannot open 'c4'")) == (
        "rank 0 (exit 2): training.dataset: cannot open 'c4'", 2)
    assert describe(RankFailure(3, 1, T, "ValueError: boom")) == ("rank 3 (exit 1): ValueError: boom", 1)
    text, code = describe(RankFailure(1, -9, T), memory="this run needs at least 38.4 GB of host memory")
    assert code == 137 and text.startswith("rank 1 was killed by SIGKILL (signal 9): most likely the kernel's "
                                           "out-of-memory killer")
    assert text.endswith("; this run needs at least 38.4 GB of host memory")
    text, code = describe(RankFailure(0, -11, T, log_dir=tmp_path / "rank0"))
    assert code == 139 and "SIGSEGV (signal 11): a crash in native code" in text
    assert str(tmp_path / "rank0" / "stderr.log") in text
    assert describe(RankFailure(0, -15, T))[1] == 143
    text, code = describe(RankFailure(0, 1, T, PEER))
    assert code == 1 and "lost its connection to another one" in text


def test_a_rank_without_a_report_is_described_by_its_last_stderr_line(tmp_path):
    (tmp_path / "rank2").mkdir()
    (tmp_path / "rank2" / "stderr.log").write_text("Traceback (most recent call last):\n  ...\n"
                                                   "ModuleNotFoundError: No module named 'trainer'\n\n")
    assert describe(RankFailure(2, 1, T, log_dir=tmp_path / "rank2")) == (
        "rank 2 exited with code 1 without reporting an error; the last line of its stderr: "
        "ModuleNotFoundError: No module named 'trainer'", 1)


def test_report_files_are_read_through_torch(tmp_path, monkeypatch):
    """What a rank writes (trainer.launch.process_exit.report_error) is what torch's ProcessFailure reads."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    import trainer.launch.process_exit as process_exit

    path = tmp_path / "rank1" / "error.json"
    path.parent.mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(process_exit, "_reported", False)
    before = time.time()
    process_exit.report_error("checkpoint.load_step=5: newer checkpoints", 2)
    process_exit.report_error("a second error while closing", 1)  # the first report counts
    failure = ProcessFailure(local_rank=1, pid=1234, exitcode=2, error_file=str(path))
    assert failure.message["message"] == "checkpoint.load_step=5: newer checkpoints"
    assert abs(failure.timestamp - before) <= 1
    ours = RankFailure.from_torch(1, failure, tmp_path)
    assert (ours.rank, ours.exitcode, ours.message) == (1, 2, "checkpoint.load_step=5: newer checkpoints")
    assert before <= ours.time <= time.time() and ours.log_dir == tmp_path / "rank1"

    killed = RankFailure.from_torch(0, ProcessFailure(local_rank=0, pid=1, exitcode=-9,
                                                      error_file=str(tmp_path / "none.json")), tmp_path)
    assert killed.message is None and killed.signal == signal.SIGKILL


def test_a_rank_stopped_by_the_agent_after_its_stop_report_saved_and_stopped(tmp_path, monkeypatch):
    """Ranks that saved and stopped on request all exit 75, each in its own time: when one exits
    first, the agent stops the ranks still running with SIGTERM, one of them maybe past its report.
    That rank saved and stopped too; a rank stopped before it reported, or one that reported an
    error, did not."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    import trainer.launch.process_exit as process_exit

    def ended(name: str, code: int | None, exitcode: int) -> RankFailure:
        path = tmp_path / name / "error.json"
        path.parent.mkdir()
        if code is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            monkeypatch.setattr(process_exit, "_reported", False)
            process_exit.report_error("saved a checkpoint at step 3 on SIGUSR1 and stopped", code)
        return RankFailure.from_torch(0, ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(path)),
                                      tmp_path)

    assert ended("exited", 75, 75).saved_and_stopped
    assert ended("terminated past its report", 75, -signal.SIGTERM).saved_and_stopped
    assert not ended("terminated before", None, -signal.SIGTERM).saved_and_stopped
    assert not ended("failed, then terminated", 2, -signal.SIGTERM).saved_and_stopped
    assert not ended("killed past its report", 75, -signal.SIGKILL).saved_and_stopped

def test_options():
    opts, rest = parse_options(["--nproc", "4", "--device", "cuda", "--log-ranks", "0,3", "--training.steps", "5"])
    assert (opts.nproc, opts.device, opts.log_ranks, rest) == (4, "cuda", {0, 3}, ["--training.steps", "5"])
    assert parse_options([]) == (Options(), [])
    for bad in (["--nproc", "0"], ["--device", "tpu"], ["--log-ranks", "a"], ["--nnodes", "2"], ["--nproc"]):
        with pytest.raises(UsageError):
            parse_options(bad)
    with pytest.raises(UsageError, match="--max-restarts: '-1' is not 'auto' or a number >= 0 \\(MAX_RESTARTS\\)"):
        parse_options(["--max-restarts", "-1"])


def test_restarts_by_default_only_when_the_run_saves_checkpoints():
    from trainer.config.manager import load_config

    auto, none = parse_options(["--max-restarts", "auto"])[0], parse_options(["--max-restarts", "0"])[0]
    assert restarts_for(auto, load_config(["--checkpoint.enable"])) == (3, "from the latest checkpoint")
    count, note = restarts_for(auto, load_config([]))
    assert count == 0 and note.startswith("from the start")
    assert restarts_for(auto, load_config(["--checkpoint.enable", "--checkpoint.load_only"]))[0] == 0
    assert restarts_for(none, load_config(["--checkpoint.enable"]))[0] == 0
    assert restarts_for(parse_options(["--max-restarts", "5"])[0], load_config([]))[0] == 5
    assert restarts_for(auto, load_config(["--checkpoint.create_seed_checkpoint"]))[0] == 0


def test_a_timeout_names_the_timeouts_and_the_stopped_rank():
    timed_out = RankFailure(0, 1, T, "RuntimeError: [/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                     "5000ms for recv operation to complete")
    killed = RankFailure(1, -signal.SIGKILL, T + 0.2, killed_stopped=True)  # by the launcher, it was stopped
    assert root_cause([killed, timed_out]) is timed_out
    text, code = describe(timed_out, hang=Hang(5, 300, stopped=[1]))
    assert code == 1 and text == (
        "rank 0 (exit 1): RuntimeError: [/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
        "operation to complete\n(a peer did not join a collective within the timeout: comm.train_timeout_seconds = "
        "5 s, comm.init_timeout_seconds = 300 s until the first step is done; rank 1 had stopped answering: it was "
        "stopped (SIGSTOP or a debugger) and killed by the launcher)")
    assert "peer did not join" not in describe(RankFailure(0, 1, T, "ValueError: boom"), hang=Hang(5, 300))[0]
    assert short_reason(timed_out) == ("exit 1: RuntimeError: [/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                       "waiting 5000ms for recv operation to complete")
    assert short_reason(RankFailure(1, -9, T)) == "killed by SIGKILL"


def test_hub_probe(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                 "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)

    def no_dns(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def slow(host, port):
        time.sleep(1)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    assert hub_unreachable(no_dns) == "huggingface.co"
    assert hub_unreachable(lambda host, port: []) is None
    assert hub_unreachable(slow, timeout_s=0.05) is None  # no answer in time: nothing is decided
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org:8443")
    assert hub_unreachable(no_dns) == "hub.example.org"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert hub_unreachable(no_dns) is None  # names resolve at the proxy


def test_hub_datasets():
    from trainer.config.manager import load_config

    assert hub_datasets(load_config([])) == []
    config = load_config(["--training.dataset", "c4", "--validation.enable", "--validation.dataset", "fineweb"])
    assert hub_datasets(config) == ["c4", "fineweb"]
    config = load_config(["--training.dataset", "c4", "--training.dataset_path", "/data/c4"])
    assert hub_datasets(config) == []


def test_a_native_crash_is_reported_with_the_frames_where_it_happened(tmp_path):
    """faulthandler's dump at the end of the rank's stderr: the crashing thread's innermost frames
    reach the console, so a crash seen only in a console log (CI) says where it was."""
    (tmp_path / "rank0").mkdir()
    frames = [f'  File "/x/m{i}.py", line {i} in f{i}' for i in range(12)]
    (tmp_path / "rank0" / "stderr.log").write_text(
        "step 3 loss 5.1\nFatal Python error: Segmentation fault\n\n"
        "Thread 0x00007fa9cc3946c0 (most recent call first):\n  File \"/x/other.py\", line 3 in sleeper\n\n"
        "Current thread 0x00007fa9cd013b80 (most recent call first):\n" + "\n".join(frames) + "\n\nExtension modules: numpy\n")
    text, code = describe(RankFailure(0, -11, T, log_dir=tmp_path / "rank0"))
    assert code == 139
    where = text.split("where it crashed (most recent call first):\n")[1].splitlines()
    assert where == [f"  {frame.strip()}" for frame in frames[:8]]
    (tmp_path / "rank1").mkdir()  # no dump (faulthandler off): the report is as before
    text, _ = describe(RankFailure(1, -11, T, log_dir=tmp_path / "rank1"))
    assert "where it crashed" not in text and text.endswith("stderr.log")


def test_a_users_mistake_is_not_retried_a_lost_peer_is():
    from trainer.launch.elastic_agent import retryable

    assert not retryable(RankFailure(0, 2, T, "checkpoint.load_step=5: newer checkpoints"))
    assert retryable(RankFailure(1, -9, T)) and retryable(RankFailure(0, 1, T, "ValueError: boom"))
    # A save that failed because a peer stopped answering is reported as exit 2, and a restart helps.
    assert retryable(RankFailure(0, 2, T, "checkpoint step-4 could not be written to run/checkpoint: RuntimeError: "
                                          "[unbound_buffer.cc:129] Timed out waiting 5000ms for send operation"))
    assert retryable(RankFailure(0, 2, T, f"checkpoint step-4 could not be written: {PEER}"))
