"""The launcher: help, config printing, clear errors, working directory independence, and how a
failing rank is reported (one message, its exit code or signal, every rank's log kept)."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import LAUNCHER, REPO, TINY_JOB, curve, descendants, describe, launch, read_metrics
from trainer.config.manager import load_config
from trainer.records.run_meta import read_record


def test_help_for_8b_config_without_building_the_model():
    result = launch(2, ["--job.config_file", "llama3_8b.toml", "--help"])
    assert result.returncode == 0, describe(result)
    assert "--training.steps  (int, default 10000)  [config: 1000]" in result.stdout
    assert "--parallelism.tensor_parallel_degree" in result.stdout


def test_print_config_of_8b_round_trips_without_allocating(tmp_path):
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = launch(2, ["--job.config_file", "llama3_8b.toml", "--training.steps", "3", "--job.print_config"])
    assert result.returncode == 0, describe(result)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert max(before, peak_kib) < 2 * 1024 * 1024  # far below the 32 GB an fp32 8B model needs
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    reloaded = load_config(["--job.config_file", str(printed)])
    original = load_config(["--job.config_file", "llama3_8b.toml", "--training.steps", "3"])
    reloaded.job.config_file = original.job.config_file
    assert reloaded == original


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stpes", "5"], "unknown key training.stpes; did you mean 'steps'?"),
        (["--training.steps", "-3"], "training.steps: must be >= 1, got -3"),
        (["--job.config_file", "missing.toml"], "'missing.toml' not found"),
        (["--parallelism.data_parallel_shard_degree", "3"], "but the world size is 2"),
        (["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "tiny", "--training.seq_len", "31"],
         "training.seq_len=31: sequence parallelism splits each rank's 31 tokens"),
        (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
          "--training.local_batch_size", "2"], "ZBVZeroBubble with 2 PP ranks and 4 stages needs at least 4 microbatches"),
        (["--training.enable_cpu_offload"], "training.enable_cpu_offload: moves FSDP state from GPU to CPU memory"),
        (["--model.converters", "float8", "--training.enable_cpu_offload"],
         "training.enable_cpu_offload: not combined with float8 layers"),
    ],
)
@pytest.mark.smoke
def test_user_mistakes_give_one_message_and_exit_2(args, message):
    result = launch(2, args)
    assert result.returncode == 2, describe(result)
    assert message in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_memory_estimation_prints_the_estimate_before_the_ranks_train(tmp_path):
    """torchtitan's memory_estimation.enable: the estimator's report of the job at the launch's
    world size, then training as usual."""
    result = launch(1, ["--model.flavor", "tiny", "--training.seq_len", "16", "--training.steps", "1",
                        "--memory_estimation.enable", "--job.dump_folder", str(tmp_path), "--checkpoint.no_enable"])
    assert result.returncode == 0, describe(result)
    out = result.stdout
    estimate = out.index("memory_estimation.enable: estimating every rank's memory at 1 ranks")
    assert estimate < out.index("rank kind") < out.index("estimated in") < out.index("logs:")
    assert re.search(r"^every rank +0 +0\.2M .* yes \(0%\)", out, re.M), out
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


@pytest.mark.cores(2)
def test_memory_estimation_on_real_tensors_runs_in_the_ranks_and_leaves_the_run_unchanged(tmp_path):
    """memory_estimation.disable_fake_mode: each rank measures two real steps under the
    estimator's tracker before training (no fake estimate in the launcher), and then trains the
    same curve as without it (its random tokens draw from their own random state)."""
    job = ["--model.flavor", "tiny", "--training.seq_len", "16", "--training.steps", "2", "--checkpoint.no_enable"]
    plain = launch(2, [*job, "--job.dump_folder", str(tmp_path / "plain")])
    real = launch(2, [*job, "--memory_estimation.enable", "--memory_estimation.disable_fake_mode",
                      "--job.dump_folder", str(tmp_path / "real")])
    assert plain.returncode == 0 and real.returncode == 0, describe(real)
    out = real.stdout + real.stderr
    assert "rank kind" not in out and "estimating every rank's memory" not in out
    found = re.search(r"memory_estimation \(real tensors, 2 steps\): rank 0 tracker peak ([\d.]+) MiB \(step: "
                      r"parameters ([\d.]+) MiB.* activations ([\d.]+) MiB.*a CPU keeps no allocator peak", out)
    assert found, out
    peak, parameters, activations = map(float, found.groups())
    assert peak >= parameters + activations and parameters > 0 and activations > 0
    losses = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "real")]
    assert losses == [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "plain")] and len(losses) == 2


def test_runs_from_another_directory_with_a_local_config(tmp_path):
    (tmp_path / "mine.toml").write_text('[model]\nflavor = "tiny"\n[training]\nseq_len = 16\nsteps = 2\n'
                                        'local_batch_size = 2\n[metrics]\nlog_freq = 1\n'
                                        '[fault_tolerance]\nenable = false\n')  # torchtitan's, ignored here
    result = launch(1, ["--job.config_file", "mine.toml", "--job.dump_folder", "out"], cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]
    assert f"outputs: {tmp_path / 'out'}" in result.stdout
    assert not (REPO / "out").exists()
    # The launcher names the ignored table once (the ranks, loading the config again, do not), and
    # the finished run records it: in the launcher's log and in run_meta.json.
    assert (result.stdout + result.stderr).count("ignoring options this trainer does not implement") == 1
    [warning] = [w for w in read_record(tmp_path / "out")["warnings"] if "ignoring options" in w]
    assert warning.startswith("warning: ignoring options") and "[fault_tolerance]" in warning
    [launcher_log] = (tmp_path / "out" / "logs").glob("*/launcher.log")
    assert f"trainer.launch.launcher: {warning}\n" in launcher_log.read_text()


def launcher_finding(port: int, folder: Path) -> list[str]:
    """`python -m trainer.launch` whose torch agent finds `port` free for the ranks' store (a script
    in `folder`: the suite's warm Python runs scripts, tests/warm_python)."""
    script = folder / "launcher_finding_a_port.py"
    script.write_text("import runpy\n"
                      "import torch.distributed.elastic.rendezvous.api as rendezvous_api\n"
                      f"rendezvous_api.get_free_port = lambda: {port}\n"
                      "runpy.run_module('trainer.launch', run_name='__main__', alter_sys=True)\n")
    return [sys.executable, str(script)]


@pytest.fixture
def taken_port():
    """A port another process listens on (on a busy machine: a gloo pair, another job's store)."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        yield holder.getsockname()[1]


LAUNCHER_ENV = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
SHORT_JOB = [*TINY_JOB, "--training.steps", "2", "--checkpoint.no_enable"]


@pytest.fixture(scope="module")
def short_curve(tmp_path_factory) -> list[tuple[int, float, float]]:
    """The curve of SHORT_JOB on 2 processes, as torchrun_launch.sh runs it."""
    folder = tmp_path_factory.mktemp("short-reference")
    reference = launch(2, [*SHORT_JOB, "--job.dump_folder", str(folder)])
    assert reference.returncode == 0, describe(reference)
    return curve(folder)


def test_a_port_taken_before_the_ranks_start_costs_no_restart(tmp_path, taken_port, short_curve):
    """torch's agent finds a port free, then starts the ranks; by the time rank 0 would listen on
    it (env://), another process can hold it, and the job failed with EADDRINUSE (or spent a
    restart). The ranks meet at a store the launcher opened before they started."""
    result = subprocess.run([*launcher_finding(taken_port, tmp_path), "--nproc", "2", "--device", "cpu", *SHORT_JOB,
                             "--job.dump_folder", str(tmp_path / "run")], cwd=REPO, env=LAUNCHER_ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "restart" not in result.stderr, describe(result)
    assert curve(tmp_path / "run") == short_curve


def test_two_nodes_meet_at_the_store_of_node_0s_launcher(tmp_path, taken_port, short_curve):
    """Two launchers of one process each (`--nnodes 2`, one c10d rendezvous) train as one job of 2
    ranks: node 1's launcher reads the port of the store node 0's launcher opened from the
    rendezvous, not the port torch found free (taken here)."""
    with socket.socket() as probe:  # the rendezvous's own port, which one launcher listens on
        probe.bind(("", 0))
        endpoint = f"localhost:{probe.getsockname()[1]}"
    launcher = launcher_finding(taken_port, tmp_path)
    nodes = [subprocess.Popen([*launcher, "--nproc", "1", "--device", "cpu", "--nnodes", "2",
                               "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", *SHORT_JOB,
                               "--job.dump_folder", str(tmp_path / f"node{node}")],
                              cwd=REPO, env=LAUNCHER_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, describe(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    # Rank 0 writes the metrics, on whichever node the rendezvous made node 0.
    [rank_0] = [folder for folder in (tmp_path / "node0", tmp_path / "node1") if (folder / "metrics.jsonl").exists()]
    assert curve(rank_0) == short_curve


@pytest.mark.cores(2)
def test_default_job_writes_metrics_and_tensorboard(tmp_path):
    """The quick start's job (debug config, defaults of the launcher), shortened to 3 steps."""
    result = launch(2, ["--training.steps", "3", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(records[0]) >= {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops", "mfu",
                               "memory", "time"}
    assert records[0]["tokens"] == 16 * 128
    assert list((tmp_path / "tb").glob("*/events.out.tfevents.*"))
    meta = json.loads((tmp_path / "run_meta.json").read_text())
    assert meta["num_params"] == 5_573_888 and meta["degrees"]["dp_shard"] == 2
    assert meta["data"]["entropy_floor_nats"] == pytest.approx(2.172, abs=1e-3)


# ---------------------------------------------------------------------------------------------
# A failing rank: one message, the rank's exit code, every rank's log kept


def error_block(result) -> tuple[str, Path]:
    """The failure report as the protocol reads it: from the last line starting `error: ` to the
    line starting `full logs: `; (the message, the log folder)."""
    lines = (result.stdout + result.stderr).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert starts, describe(result)
    ends = [i for i in range(starts[-1], len(lines)) if lines[i].startswith("full logs: ")]
    assert ends, describe(result)
    message = "\n".join(lines[starts[-1]:ends[0]])[len("error: "):]
    return message, Path(lines[ends[0]][len("full logs: "):])


def assert_one_report(result, nproc: int) -> tuple[str, Path]:
    """Exactly one `error:` line and nothing of torchrun's report; every rank's log in the folder."""
    output = result.stdout + result.stderr
    assert sum(line.startswith("error: ") for line in output.splitlines()) == 1, describe(result)
    assert "ChildFailedError" not in output and "torch.distributed.elastic" not in output, describe(result)
    assert "closing signal" not in output, describe(result)
    message, folder = error_block(result)
    assert folder.is_dir() and folder.parent.name == "logs"
    for rank in range(nproc):
        assert (folder / f"rank{rank}" / "stdout.log").is_file() and (folder / f"rank{rank}" / "stderr.log").is_file()
    return message, folder


def write_checkpoint(folder: Path, **shape) -> Path:
    """A model-only step-0 DCP checkpoint of the tiny flavor, with `shape` changed."""
    from trainer.checkpoint.manager import save_seed_checkpoint
    from trainer.models.llama3 import Transformer, get_flavor

    args = get_flavor("tiny")
    for key, value in shape.items():
        setattr(args, key, value)
    args.max_seq_len = 32
    model = Transformer(args)
    model.init_weights(seed=3)
    return save_seed_checkpoint(model, folder, overwrite=False)


FAILING_JOB = [*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "4"]


def test_checkpoint_of_another_model_is_one_message_exit_2(tmp_path, measured):
    other = write_checkpoint(tmp_path / "other", dim=32, vocab_size=128)
    started = time.perf_counter()
    result = launch(2, [*FAILING_JOB, "--checkpoint.initial_load_path", str(other),
                        "--job.dump_folder", str(tmp_path / "run")])
    measured(f"launcher, checkpoint of another model on 2 ranks: exit {result.returncode} after "
             f"{time.perf_counter() - started:.1f} s")
    assert result.returncode == 2, describe(result)
    message, folder = assert_one_report(result, 2)
    assert re.fullmatch(r"rank [01] \(exit 2\): \S+: parameter tok_embeddings.weight has shape \[128, 32\] in the "
                        r"checkpoint but \[256, 64\] in this model \(tiny\).*", message), message
    assert "Traceback" not in result.stdout + result.stderr
    assert folder == (tmp_path / "run" / "logs").resolve() / folder.name
    assert (result.stdout + result.stderr).count("parameter tok_embeddings.weight has shape") == 1  # said once
    rank = int(message.split()[1])
    assert "parameter tok_embeddings.weight" in (folder / f"rank{rank}" / "error.json").read_text()


def test_load_step_that_would_overwrite_newer_checkpoints_is_one_message_exit_2(tmp_path):
    seed = write_checkpoint(tmp_path / "run" / "checkpoint")
    for step in (5, 10):
        shutil.copytree(seed, tmp_path / "run" / "checkpoint" / f"step-{step}")
    result = launch(2, [*FAILING_JOB, "--checkpoint.enable", "--checkpoint.load_step", "5",
                        "--job.dump_folder", str(tmp_path / "run")])
    assert result.returncode == 2, describe(result)
    message, _ = assert_one_report(result, 2)
    assert "checkpoint.load_step=5: " in message and "holds newer checkpoints (step-10)" in message, message
    assert "restart" not in result.stderr  # checkpoint.enable gives restarts, but never after a user's mistake


def test_exception_in_a_rank_gives_its_last_traceback_line_and_exit_code(tmp_path):
    """Rank 0 cannot create its TensorBoard folder (a file is in the way); rank 1 then loses its
    peer or is stopped: rank 0 is the cause."""
    (tmp_path / "tb").write_text("not a folder")
    result = launch(2, [*FAILING_JOB, "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 1, describe(result)
    message, folder = assert_one_report(result, 2)
    traceback_end = (folder / "rank0" / "stderr.log").read_text().strip().splitlines()[-1]
    assert traceback_end.startswith(("NotADirectoryError", "FileExistsError")), traceback_end
    assert message == f"rank 0 (exit 1): {traceback_end}"


def rank_process(launcher_pid: int, rank: int) -> int | None:
    """The pid of a rank started (directly or not) by the launcher, from /proc (Linux)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_ERROR_FILE" in b"".join(environ):
            return pid
    return None


@pytest.mark.smoke
@pytest.mark.cores(2)
@pytest.mark.real_processes  # the rank is found below the launcher
def test_rank_killed_by_sigkill_is_named_exit_137(tmp_path):
    env = dict(os.environ, NGPU="2", PYTHON=sys.executable, LOG_RANK="0", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([str(LAUNCHER), *TINY_JOB, "--training.steps", "100000", "--metrics.log_freq", "1000",
                             "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").is_file() or not (tmp_path / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        pid = rank_process(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert result.returncode == 128 + signal.SIGKILL, describe(result)
    message, _ = assert_one_report(result, 2)
    assert message.startswith("rank 1 was killed by SIGKILL (signal 9): most likely the kernel's out-of-memory "
                              "killer"), message
    assert "this run needs at least" in message and "of host memory" in message


def test_launcher_settings_are_checked_before_anything_starts():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", NGPU="abc")
    bad_ngpu = subprocess.run([str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad_ngpu.returncode == 2 and "error: NGPU: 'abc' is not a number of processes" in bad_ngpu.stderr
    outside = launch(2, ["--training.steps", "1"], log_rank="5")
    assert outside.returncode == 2, describe(outside)
    assert "LOG_RANK): rank 5 is not one of this machine's 2 processes (0-1)" in outside.stderr
    assert "logs:" not in outside.stdout  # nothing started


def test_preflight_help():
    done = subprocess.run([sys.executable, "-m", "trainer.preflight", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m trainer.preflight --nproc N")
