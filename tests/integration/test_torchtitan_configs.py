"""torchtitan v0.2.2's own Llama 3 configs load as they are, and its debug config trains.

The four configs (debug model, 8B, 70B, 405B) are rebuilt here as TOML with torchtitan's sections,
keys and values (float8 quantization, async TP, profiling and validation included). Each goes
through the launcher with `--job.print_config`: it loads, the keys this trainer does not implement
are named in one warning, and the printed TOML loads back to the same settings (read back in the
test's process by the calls trainer.train makes, so each config costs one launch). The debug
config then trains for 2 steps with nothing added but the local copy of its data: torchtitan's
test assets are rebuilt in a working folder as torchtitan's repository has them
(tests/assets/tokenizer, a bare byte-level BPE tokenizer.json beside a tokenizer_config.json
naming the special tokens; a small c4_test).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import describe, launch, read_metrics
from tests.unit.test_data_named import c4_records
from tests.unit.test_tokenizer_specials import bare_bpe, folder, torchtitan_like_config
from trainer.config.manager import load_config, to_toml, with_default_config
from trainer.records.run_meta import read_record

SHARED = {
    "job": {"dump_folder": "./outputs"},
    "profiling": {"enable_profiling": True, "save_traces_folder": "profile_trace", "profile_freq": 100},
    "metrics": {"log_freq": 10, "enable_tensorboard": True, "save_tb_folder": "tb"},
    "model": {"name": "llama3"},
    "optimizer": {"name": "AdamW", "eps": 1e-8},
    "training": {"max_norm": 1.0, "dataset": "c4"},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "context_parallel_degree": 1},
    "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 500, "last_save_model_only": True,
                   "export_dtype": "float32", "async_mode": "disabled"},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
    "compile": {"enable": False, "components": ["model", "loss"]},
    "quantize.linear.float8": {"enable_fsdp_float8_all_gather": False,
                               "precompute_float8_dynamic_scale_for_fsdp": False, "filter_fqns": ["output"]},
    "validation": {"enable": False, "dataset": "c4_validation", "freq": 500, "steps": 1200},
}
CHANGES = {
    "debug_model": {
        "job": {"description": "Llama 3 debug training", "print_config": False},
        "profiling": {"enable_profiling": False, "profile_freq": 10, "enable_memory_snapshot": False,
                      "save_memory_snapshot_folder": "memory_snapshot"},
        "metrics": {"log_freq": 1, "disable_color_printing": False, "enable_tensorboard": False, "enable_wandb": False},
        "model": {"flavor": "debugmodel", "hf_assets_path": "./tests/assets/tokenizer"},
        "optimizer": {"lr": 8e-4},
        "lr_scheduler": {"warmup_steps": 2, "decay_ratio": 0.8, "decay_type": "linear", "min_lr_factor": 0.0},
        "training": {"local_batch_size": 8, "seq_len": 2048, "steps": 10, "dataset": "c4_test"},
        "parallelism": {"fsdp_reshard_after_forward": "default", "enable_async_tensor_parallel": False,
                        "pipeline_parallel_schedule": "Interleaved1F1B"},
        "checkpoint": {"interval": 10, "last_save_model_only": False},
        "activation_checkpoint": {"selective_ac_option": "2"},
        "validation": {"freq": 5, "steps": 10},
    },
    "llama3_8b": {
        "job": {"description": "Llama 3 8B training"},
        "model": {"flavor": "8B", "hf_assets_path": "./assets/hf/Llama-3.1-8B"},
        "optimizer": {"lr": 3e-4}, "lr_scheduler": {"warmup_steps": 200},
        "training": {"local_batch_size": 1, "seq_len": 8192, "steps": 1000},
    },
    "llama3_70b": {
        "job": {"description": "Llama 3 70B training"},
        "model": {"flavor": "70B", "hf_assets_path": "./assets/hf/Llama-3.1-70B"},
        "optimizer": {"lr": 1.5e-4}, "lr_scheduler": {"warmup_steps": 200},
        "training": {"local_batch_size": 8, "seq_len": 8192, "steps": 1000},
        "parallelism": {"tensor_parallel_degree": 8},
        "activation_checkpoint": {"mode": "full"},
    },
    "llama3_405b": {
        "job": {"description": "Llama 3 405B training"},
        "model": {"flavor": "405B", "hf_assets_path": "./assets/hf/Llama-3.1-405B", "converters": ["float8"]},
        "optimizer": {"lr": 8e-5}, "lr_scheduler": {"warmup_steps": 600},
        "training": {"local_batch_size": 2, "seq_len": 8192, "steps": 3000},
        "parallelism": {"tensor_parallel_degree": 8, "enable_async_tensor_parallel": True},
        "activation_checkpoint": {"mode": "full"},
        "compile": {"enable": True},
        "quantize.linear.float8": {"enable_fsdp_float8_all_gather": True,
                                   "precompute_float8_dynamic_scale_for_fsdp": True},
    },
}


def torchtitan_config(name: str) -> dict:
    sections = {section: dict(keys) for section, keys in SHARED.items()}
    for section, keys in CHANGES[name].items():
        sections.setdefault(section, {}).update(keys)
    if name == "debug_model":  # the debug config sets no recomputation option but the layer interval
        sections["activation_checkpoint"] = {"mode": "selective", "selective_ac_option": "2"}
    return sections


def toml_text(sections: dict) -> str:
    def value(v) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {value(v)}" for key, v in keys.items()]
        lines.append("")
    return "\n".join(lines)


@pytest.fixture
def workdir(tmp_path):
    """A working folder holding the four configs and torchtitan's test assets, rebuilt."""
    for name in CHANGES:
        (tmp_path / f"{name}.toml").write_text(toml_text(torchtitan_config(name)))
    spec, vocab = bare_bpe()
    folder(tmp_path / "tests" / "assets" / "tokenizer", spec, {"tokenizer_config.json": torchtitan_like_config(vocab)})
    (tmp_path / "tests" / "assets" / "c4_test").mkdir(parents=True)
    with open(tmp_path / "tests" / "assets" / "c4_test" / "data.json", "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in c4_records("train", 300))
    return tmp_path


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_torchtitan_config_loads_and_prints(name, workdir, monkeypatch):
    printed = launch(8, ["--job.config_file", str(workdir / f"{name}.toml"), "--job.print_config"], cwd=workdir)
    assert printed.returncode == 0, describe(printed)
    # Every key of torchtitan's Llama configs is implemented: nothing is ignored.
    assert "ignoring options" not in printed.stdout + printed.stderr, describe(printed)
    toml = printed.stdout
    if name == "llama3_405b":  # its float8 converter, under its earlier name, with float8 all-gather
        assert 'converters = [\n    "float8",\n]' in toml and "enable_fsdp_float8_all_gather = true" in toml, toml
    config = torchtitan_config(name)
    assert f'flavor = "{config["model"]["flavor"]}"' in toml
    assert f"seq_len = {config['training']['seq_len']}" in toml
    assert f'mode = "{config["activation_checkpoint"]["mode"]}"' in toml
    (workdir / "printed.toml").write_text(toml)
    # Loaded back as trainer.train loads and prints it (the launcher's path to it is checked above).
    monkeypatch.chdir(workdir)
    again = load_config(with_default_config(["--job.config_file", str(workdir / "printed.toml"), "--job.print_config"]))
    assert again.job.print_config
    again.job.print_config = False  # as trainer.train does before printing

    def settings(text: str) -> list[str]:  # all but the line naming the file it came from
        return [line for line in text.splitlines() if not line.startswith("config_file =")]

    assert settings(to_toml(again)) == settings(toml)


def test_the_torchtitan_debug_config_trains_with_only_a_data_path(workdir):
    # One process: what the config computes per rank (8 x 2048 tokens a step) is the same on any
    # number of them; the keys, assets and first loss checked here are those of every rank.
    result = launch(1, ["--job.config_file", str(workdir / "debug_model.toml"), "--training.dataset_path",
                        "tests/assets/c4_test", "--training.steps", "2"], cwd=workdir, timeout=600)
    assert result.returncode == 0, describe(result)
    assert "activation checkpointing selective (2)" in result.stdout
    # Every key of it is implemented (its [quantize.linear.float8] table too, float8 off as in
    # torchtitan): no warning, in the output or in the run's record.
    assert "ignoring options" not in result.stdout + result.stderr
    assert not [w for w in read_record(workdir / "outputs")["warnings"] if "ignoring options" in w]
    records = read_metrics(workdir / "outputs")
    assert [r["step"] for r in records] == [1, 2]
    # At init the loss is about ln V + 0.99^2 / 2 = 8.11 for the debug model's 2048 rows (README), in
    # expectation over the initial weights: on one draw the few, frequent target tokens of a batch
    # meet fixed random output rows, which moves the first loss by about 0.2 (debug.seed 0-5 on the
    # c4 batch of test_torchtitan_names.py: 7.69, 8.11, 8.09, 8.08, 8.01, 8.37). The bound is three
    # times that spread.
    assert abs(records[0]["loss"] - (math.log(2048) + 0.99 ** 2 / 2)) < 0.6
    assert records[1]["loss"] < records[0]["loss"]
