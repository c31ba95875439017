"""The host memory check: what a run holds in CPU memory, counted from the model's shapes, against
MemAvailable of /proc/meminfo (a fake one here)."""

from __future__ import annotations

import os

import pytest

import trainer.preflight.checks as preflight
from trainer.config.manager import ConfigError, load_config
from trainer.models.llama3.args import get_flavor, num_params
from trainer.preflight.checks import (
    available_memory,
    check,
    check_seed,
    plan_run,
    seed_memory_need,
    training_memory_need,
)


def meminfo(tmp_path, available_bytes: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {2 * available_bytes // 1024} kB\nMemFree:        1024 kB\n"
                    f"MemAvailable:   {available_bytes // 1024} kB\n")
    return path


GB16 = 16_000_000_000


def test_8b_seed_is_refused_with_the_figures(tmp_path):
    config = load_config(["--model.flavor", "8B"])
    params = num_params(get_flavor("8B"))
    need = 4 * params + 4 * 128256 * 4096  # float32 weights + the embedding drawn in full while initialized
    assert seed_memory_need(config).bytes == need
    with pytest.raises(ConfigError) as refused:
        check_seed(config, meminfo(tmp_path, GB16))
    message = str(refused.value)
    assert message.startswith("model.flavor 8B: creating the seed checkpoint builds the whole model")
    assert f"{need / 1e9:.1f} GB of host memory" in message and "34.2 GB" in message
    assert "16.0 GB available (MemAvailable in" in message
    assert "8.03e9 parameters x 4 bytes" in message


def test_debug_model_passes(tmp_path):
    small = meminfo(tmp_path, 1_000_000_000)  # 1 GB available is plenty for 5.6M parameters
    config = load_config(["--job.config_file", "debug_model.toml"])
    check_seed(config, small)
    plan = check(config, 2, "cpu", meminfo=small)
    need = training_memory_need(config, plan.dims, "cpu", 2)
    # 16 bytes x 5.57e6 parameters, plus two init buffers and two steps' activations (float32 on a
    # CPU: 117,760 bytes for each of 8 x 128 tokens, at least: trainer/preflight/step_bound.py).
    assert need.activations.tokens == 8 * 128 and need.activations.per_token == 117_760
    assert 150_000_000 < need.bytes < 350_000_000


def test_8b_training_on_cpu_is_refused_but_not_on_gpus(tmp_path):
    fake = meminfo(tmp_path, GB16)
    config = load_config(["--job.config_file", "llama3_8b.toml"])
    with pytest.raises(ConfigError, match=r"model.flavor 8B: 2 processes on cpu hold parameters, gradients and Adam "
                                          r"state in float32 \(8.03e9 parameters x 16 bytes.*and a step's activations \(9.7 GB per "
                                          r"process at least, 8,192 tokens\): 152.1 GB of host "
                                          r"memory, but this machine has 16.0 GB available"):
        check(config, 2, "cpu", meminfo=fake)
    check(config, 8, "cuda", meminfo=fake)  # the model state lives on the GPUs


def test_replicas_multiply_the_model_state(tmp_path):
    config = load_config(["--model.flavor", "debugmodel"])
    fsdp = training_memory_need(config, plan_run(config, 2).dims, "cpu", 2).bytes
    config = load_config(["--model.flavor", "debugmodel", "--parallelism.data_parallel_replicate_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "1"])
    ddp = training_memory_need(config, plan_run(config, 2).dims, "cpu", 2).bytes
    state = 16 * num_params(get_flavor("debugmodel"))
    assert ddp - fsdp == state


def test_hugging_face_load_counts_every_local_rank_copy(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with open(hf / "model.safetensors", "wb") as f:
        f.truncate(3_000_000_000)  # sparse: 3 GB on paper
    args = ["--job.config_file", "llama3_8b.toml", "--checkpoint.initial_load_path", str(hf),
            "--checkpoint.initial_load_in_hf", "--job.dump_folder", str(tmp_path / "run")]
    config = load_config(args)
    need = training_memory_need(config, plan_run(config, 8).dims, "cuda", 8)
    assert need.bytes == 8 * 3_000_000_000
    with pytest.raises(ConfigError, match=r"8 processes on cuda hold each process's full copy of .*: 24.0 GB .* "
                                          r"convert the folder once \(python -m trainer.hf"):
        check(config, 8, "cuda", meminfo=meminfo(tmp_path, GB16))
    assert training_memory_need(config, plan_run(config, 16).dims, "cuda", 4).bytes == 4 * 3_000_000_000

    # A run that resumes its own checkpoint does not read the folder.
    (tmp_path / "run" / "checkpoint" / "step-10").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "step-10" / ".metadata").write_bytes(b"")
    config = load_config([*args, "--checkpoint.enable"])
    assert training_memory_need(config, plan_run(config, 8).dims, "cuda", 8) is None


def test_unreadable_meminfo_skips_the_check(tmp_path):
    assert available_memory(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("MemTotal: 10 kB\n")
    assert available_memory(tmp_path / "odd") is None
    check_seed(load_config(["--model.flavor", "8B"]), tmp_path / "missing")
    assert available_memory(meminfo(tmp_path, GB16)) == GB16 // 1024 * 1024


def test_skip_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SKIP_MEMORY_CHECK", "1")
    check_seed(load_config(["--model.flavor", "8B"]), meminfo(tmp_path, GB16))


def test_seed_process_refuses_before_building_the_model(tmp_path, monkeypatch):
    """create_seed_checkpoint itself (what `python -m trainer.train` runs) refuses before any allocation."""
    import trainer.checkpoint.seed as seed

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo(tmp_path, GB16)))
    monkeypatch.setattr(seed, "Transformer", no_model)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = load_config(["--model.flavor", "8B", "--job.dump_folder", str(tmp_path / "seed")])
    with pytest.raises(ConfigError, match="model.flavor 8B: creating the seed checkpoint"):
        seed.create_seed_checkpoint(config)


def test_launcher_refuses_the_8b_seed_with_one_message(tmp_path, monkeypatch, capsys):
    from trainer.launch import launcher

    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo(tmp_path, GB16)))
    code = launcher.main(["--nproc", "8", "--device", "cpu", "--job.config_file", "llama3_8b.toml",
                          "--job.dump_folder", str(tmp_path / "seed"), "--checkpoint.create_seed_checkpoint"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: model.flavor 8B: creating the seed checkpoint") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "seed")  # nothing was started, no log folder


def test_preflight_takes_the_processes_of_one_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "MEMINFO", str(meminfo(tmp_path, GB16)))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with open(hf / "model.safetensors", "wb") as f:
        f.truncate(3_000_000_000)
    args = ["--job.config_file", "llama3_8b.toml", "--checkpoint.initial_load_path", str(hf),
            "--checkpoint.initial_load_in_hf", "--job.dump_folder", str(tmp_path / "run")]
    assert preflight.main(["--nproc", "16", "--device", "cuda", *args]) == 2  # 16 copies of 3 GB on one machine
    assert "48.0 GB of host memory" in capsys.readouterr().err
    assert preflight.main(["--nproc", "16", "--device", "cuda", "--nproc-per-node", "4", *args]) == 0
