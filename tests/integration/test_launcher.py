"""The launcher: help, config printing, clear errors, working directory independence."""

from __future__ import annotations

import json
import resource

import pytest

from tests.launch import REPO, describe, launch, read_metrics
from trainer.config.manager import load_config


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
    ],
)
def test_user_mistakes_give_one_message_and_exit_2(args, message):
    result = launch(2, args)
    assert result.returncode == 2, describe(result)
    assert message in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_runs_from_another_directory_with_a_local_config(tmp_path):
    (tmp_path / "mine.toml").write_text('[model]\nflavor = "tiny"\n[training]\nseq_len = 16\nsteps = 2\n'
                                        'local_batch_size = 2\n[metrics]\nlog_freq = 1\n')
    result = launch(1, ["--job.config_file", "mine.toml", "--job.dump_folder", "out"], cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]
    assert f"outputs: {tmp_path / 'out'}" in result.stdout
    assert not (REPO / "out").exists()


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
