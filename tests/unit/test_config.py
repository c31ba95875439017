"""Config loading: precedence, every command-line syntax, every error, TOML round trip."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import pytest

from trainer.config.job_config import JobConfig
from trainer.config.manager import (
    TRAIN_CONFIGS_DIR,
    ConfigError,
    field_docs,
    leaf_owner,
    leaf_types,
    help_text,
    load_config,
    parse_cli,
    sections,
    to_toml,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_without_file():
    config = load_config([])
    defaults = JobConfig()
    defaults.validation.local_batch_size, defaults.validation.seq_len = 8, 2048  # unset: training's
    assert config == defaults
    assert config.parallelism.data_parallel_shard_degree == -1
    assert config.job.config_file == ""


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, """
        [training]
        steps = 7
        seq_len = 64
        [optimizer]
        lr = 0.01
    """)
    config = load_config(["--job.config_file", path, "--training.steps", "3"])
    assert config.training.steps == 3  # command line beats TOML
    assert config.training.seq_len == 64  # TOML beats default
    assert config.optimizer.lr == 0.01
    assert config.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert config.job.config_file == path


def test_cli_order_does_not_matter_for_config_file(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    config = load_config(["--training.steps", "3", "--job.config_file", path])
    assert (config.training.steps, config.training.seq_len) == (3, 64)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "5"], 5),
        (["--training.steps=5"], 5),
        (["--training.steps=5", "--training.steps", "6"], 6),  # last one wins
    ],
)
def test_value_syntaxes(argv, expected):
    assert load_config(argv).training.steps == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--debug.deterministic"], True),
        (["--debug.deterministic=true"], True),
        (["--debug.deterministic", "true"], True),
        (["--debug.deterministic=false"], False),
        (["--debug.deterministic", "false"], False),
        (["--debug.deterministic", "--debug.no_deterministic"], False),
        (["--debug.no-deterministic"], False),
        (["--debug.deterministic", "--training.steps", "4"], True),
    ],
)
def test_boolean_syntaxes(argv, expected):
    assert load_config(argv).debug.deterministic is expected


def test_negated_flag_turns_off_a_toml_true(tmp_path):
    path = write(tmp_path, "[metrics]\nenable_tensorboard = true\n")
    assert load_config(["--job.config_file", path]).metrics.enable_tensorboard is True
    assert load_config(["--job.config_file", path, "--metrics.no_enable_tensorboard"]).metrics.enable_tensorboard is False


def test_lists_comma_separated_and_from_toml(tmp_path):
    config = load_config(["--checkpoint.exclude_from_loading", "optimizer,dataloader"])
    assert config.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    path = write(tmp_path, '[compile]\ncomponents = ["model"]\n')
    assert load_config(["--job.config_file", path]).compile.components == ["model"]


def test_optional_and_float_values():
    config = load_config(["--lr_scheduler.decay_ratio", "0.25", "--optimizer.lr", "1e-3"])
    assert config.lr_scheduler.decay_ratio == 0.25
    assert config.optimizer.lr == pytest.approx(1e-3)
    assert load_config(["--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None


def test_config_file_found_in_train_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(["--job.config_file", "debug_model.toml"])
    assert Path(config.job.config_file) == TRAIN_CONFIGS_DIR / "debug_model.toml"
    assert config.model.flavor == "debugmodel"


def test_config_file_in_working_directory_wins(tmp_path, monkeypatch):
    (tmp_path / "debug_model.toml").write_text('[model]\nflavor = "tiny"\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(["--job.config_file", "debug_model.toml"])
    assert config.model.flavor == "tiny"


# ---------------------------------------------------------------------------------------------
# Errors: one clear message each, naming the key and its source


def error_of(argv) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return str(info.value)


def test_unknown_key_in_toml_names_file_and_suggests(tmp_path):
    path = write(tmp_path, "[training]\nstpes = 5\n")
    message = error_of(["--job.config_file", path])
    assert path in message and "training.stpes" in message and "did you mean 'steps'" in message


def test_unknown_section_in_toml(tmp_path):
    path = write(tmp_path, "[trainng]\nsteps = 5\n")
    message = error_of(["--job.config_file", path])
    assert "unknown section [trainng]" in message and "did you mean 'training'" in message


def test_unknown_key_on_command_line():
    message = error_of(["--optimizer.learning_rate", "1"])
    assert "--optimizer.learning_rate" in message and "unknown key optimizer.learning_rate" in message


def test_unknown_section_on_command_line():
    assert "did you mean 'optimizer'" in error_of(["--optimiser.lr", "1"])


def test_wrong_types(tmp_path):
    assert "expected an integer, got 'five'" in error_of(["--training.steps", "five"])
    assert "expected a number" in error_of(["--optimizer.lr", "fast"])
    assert "expected true or false" in error_of(["--debug.deterministic=maybe"])
    path = write(tmp_path, '[training]\nsteps = "10"\n')
    message = error_of(["--job.config_file", path])
    assert "training.steps" in message and "expected an integer" in message


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.steps", "-1"], "training.steps: must be >= 1, got -1"),
        (["--training.local_batch_size", "0"], "training.local_batch_size: must be >= 1"),
        (["--optimizer.name", "SGD"], "choose one of 'AdamW', 'Adam'"),
        (["--lr_scheduler.decay_type", "cosin"], "did you mean 'cosine'"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio: must be in [0, 1]"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2: must be in [0, 1)"),
        (["--model.flavor", "9B"], "model.flavor: '9B' is unknown; choose one of"),
        (["--parallelism.data_parallel_shard_degree", "0"], "data_parallel_shard_degree: must be >= 1 or -1 (the rest of the world), got 0"),
        (["--checkpoint.exclude_from_loading", "weights"], "'weights' is unknown"),
        (["--activation_checkpoint.selective_ac_option", "x"], "selective_ac_option"),
    ],
)
def test_invalid_values(argv, fragment):
    assert fragment in error_of(argv)


def test_weight_decay_exclude_names_the_key_and_the_kinds():
    message = error_of(["--optimizer.weight_decay_exclude", "norm,embeddings"])
    assert "optimizer.weight_decay_exclude: 'embeddings' is not valid" in message
    assert "choose one of 'norm', 'embedding', 'output', 'bias'" in message
    assert load_config(["--optimizer.weight_decay_exclude", "norm,output"]).optimizer.weight_decay_exclude == [
        "norm", "output"]


def test_several_problems_reported_together():
    message = error_of(["--training.steps", "0", "--optimizer.lr", "-1"])
    assert "training.steps" in message and "optimizer.lr" in message


def test_missing_config_file_lists_shipped_configs():
    message = error_of(["--job.config_file", "nope.toml"])
    assert "'nope.toml' not found" in message and "llama3_8b.toml" in message


def test_invalid_toml_syntax(tmp_path):
    path = write(tmp_path, "[training\nsteps = 5\n")
    assert "not valid TOML" in error_of(["--job.config_file", path])


def test_bad_argument_shapes():
    assert "expected --section.key" in error_of(["steps=5"])
    assert "missing value" in error_of(["--training.steps"])
    assert "takes no value" in error_of(["--debug.no_deterministic=true"])


def test_torchtitan_sections_warn_once(tmp_path, caplog):
    path = write(tmp_path, """
        [profiling]
        enable_profiling = true
        [quantize.linear.float8]
        enable_fsdp_float8_all_gather = true
        [quantize.linear.mx]
        recipe_name = "mxfp8_cublas"
        [fault_tolerance]
        enable = false
        [parallelism]
        expert_parallel_degree = 1
        [training]
        steps = 3
    """)
    with caplog.at_level(logging.WARNING):
        config = load_config(["--job.config_file", path])
    assert config.training.steps == 3
    assert config.profiling.enable_profiling  # implemented: read, not ignored
    assert config.quantize.linear.float8.enable_fsdp_float8_all_gather  # implemented, in its nested table
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for name in ("quantize.linear.mx", "[fault_tolerance]", "parallelism.expert_parallel_degree"):
        assert name in warnings[0]
    assert "profiling" not in warnings[0] and "float8" not in warnings[0]


# ---------------------------------------------------------------------------------------------
# Round trip, help, docs


def test_print_config_round_trips(tmp_path):
    config = load_config([
        "--job.config_file", "llama3_8b.toml", "--training.steps", "17", "--lr_scheduler.decay_ratio", "0.2",
        "--checkpoint.exclude_from_loading", "optimizer", "--debug.deterministic",
    ])
    path = write(tmp_path, to_toml(config), "printed.toml")
    again = load_config(["--job.config_file", path])
    again.job.config_file = config.job.config_file
    assert again == config


def test_a_mixture_is_an_array_of_tables_that_round_trips(tmp_path):
    path = write(tmp_path, """
        [[training.datasets]]
        path = "/data/web"
        weight = 0.7

        [[training.datasets]]
        dataset = "files"
        path = "/data/code/*.jsonl"
        weight = 0.3
        name = "code"
    """)
    config = load_config(["--job.config_file", path])
    assert [(d.dataset, d.path, d.weight, d.name) for d in config.training.datasets] == [
        ("shards", "/data/web", 0.7, ""), ("files", "/data/code/*.jsonl", 0.3, "code")]
    again = load_config(["--job.config_file", write(tmp_path, to_toml(config), "printed.toml")])
    assert again.training.datasets == config.training.datasets
    wrong_key = write(tmp_path, '[[training.datasets]]\npath = "x"\nweigth = 2\n', "bad.toml")
    assert "training.datasets[0]: unknown key 'weigth'; did you mean 'weight'?" in error_of(["--job.config_file", wrong_key])
    wrong_kind = write(tmp_path, '[[training.datasets]]\ndataset = "c4"\n', "bad2.toml")
    assert "training.datasets[0].dataset: 'c4' is not valid; choose one of 'shards', 'files'" in error_of(
        ["--job.config_file", wrong_kind])
    assert "a list of tables, set in the TOML file as [[training.datasets]] tables" in error_of(
        ["--training.datasets", "x"])


def test_every_field_has_a_docstring_and_appears_in_help():
    text = help_text()
    for section, cls in sections().items():
        for key in leaf_types(cls):  # dotted below a table field: quantize.linear.float8.emulate
            owner, name = leaf_owner(cls, key)
            assert field_docs(owner).get(name), f"{section}.{key} has no docstring"
            assert f"--{section}.{key}  (" in text
    assert "--quantize.linear.float8.recipe_name  (" in text


def test_help_shows_type_default_and_config_value():
    text = help_text(load_config(["--job.config_file", "llama3_8b.toml"]))
    assert "--training.steps  (int, default 10000)  [config: 1000]" in text
    assert "--lr_scheduler.decay_type  ('linear' | 'sqrt' | 'cosine', default 'linear')" in text


def test_parse_cli_keeps_raw_values():
    assert parse_cli(["--training.steps=5", "--debug.deterministic"]) == [
        ("training", "steps", "5"), ("debug", "deterministic", True)]


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the docstrings; regenerate it when they change."""
    generated = subprocess.run([sys.executable, "-m", "trainer.config.docs"], capture_output=True, text=True,
                               check=True, cwd=REPO).stdout
    assert (REPO / "docs" / "configuration.md").read_text() == generated


def test_shipped_configs_load():
    for path in sorted(TRAIN_CONFIGS_DIR.glob("*.toml")):
        config = load_config(["--job.config_file", str(path)])
        assert config.job.config_file == str(path)


@pytest.mark.parametrize("degree", ["1", "2"])
def test_an_unavailable_cp_rotate_method_is_refused_whatever_the_degree(degree):
    with pytest.raises(ConfigError, match="context_parallel_rotate_method: 'alltoall' is not available"):
        load_config(["--parallelism.context_parallel_degree", degree,
                     "--parallelism.context_parallel_rotate_method", "alltoall"])


def test_validation_batches_take_the_training_shape_unless_set():
    config = load_config(["--job.config_file", "debug_model.toml", "--validation.enable"])
    assert (config.validation.seq_len, config.validation.local_batch_size) == (128, 8)
    config = load_config(["--job.config_file", "debug_model.toml", "--training.seq_len", "64",
                          "--validation.local_batch_size", "2"])
    assert (config.validation.seq_len, config.validation.local_batch_size) == (64, 2)


def test_entry_points_train_the_embedded_default_config_without_a_file():
    from trainer.config.manager import with_default_config

    assert with_default_config(["--training.steps", "5"]) == ["--job.config_file", "debug_model.toml",
                                                              "--training.steps", "5"]
    assert with_default_config(["--job.config_file=llama3_8b.toml"]) == ["--job.config_file=llama3_8b.toml"]
    config = load_config(with_default_config([]))
    assert (config.model.flavor, config.training.seq_len, config.lr_scheduler.warmup_steps) == ("debugmodel", 128, 10)
    assert Path(config.job.config_file).name == "debug_model.toml"
    assert load_config(with_default_config(["--job.config_file", ""])).training.seq_len == 2048  # bare defaults


def test_python_m_trainer_train_prints_the_default_config():
    done = subprocess.run([sys.executable, "-m", "trainer.train", "--job.print_config"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 'flavor = "debugmodel"' in done.stdout and "seq_len = 128" in done.stdout


# ---------------------------------------------------------------------------------------------
# training.dtype, lr_scheduler.total_steps, validation.steps = -1, job.save_config_file


def test_full_bfloat16_training_computes_in_bfloat16():
    config = load_config(["--training.dtype", "bfloat16"])
    assert (config.training.dtype, config.training.mixed_precision_param) == ("bfloat16", "bfloat16")
    assert load_config(["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]) == config
    assert load_config([]).training.mixed_precision_param == "auto"  # float32 runs keep auto


@pytest.mark.parametrize("argv, fragment", [
    (["--training.mixed_precision_param", "float32"],
     "training.mixed_precision_param: 'float32' would cast the bfloat16 parameters of training.dtype = 'bfloat16' up "
     "for compute; use 'auto' or 'bfloat16'"),
    (["--training.mixed_precision_param", "float16"],
     "training.mixed_precision_param: 'float16' (computed with dynamic loss scaling) cannot be combined with "
     "training.dtype = 'bfloat16'"),
    (["--debug.init_perturbation", "1"], "debug.init_perturbation: 1.0 rounding errors cannot be applied to weights "
     "stored in bfloat16"),
])
def test_what_full_bfloat16_training_cannot_be_combined_with_is_refused(argv, fragment):
    assert fragment in error_of(["--training.dtype", "bfloat16", *argv])


def test_training_dtype_values():
    assert "choose one of 'float32', 'bfloat16'" in error_of(["--training.dtype", "float16"])


def test_schedule_horizon_and_whole_split_values():
    assert load_config(["--lr_scheduler.total_steps", "200"]).lr_scheduler.total_steps == 200
    assert load_config(["--lr_scheduler.total_steps", "none"]).lr_scheduler.total_steps is None
    assert "lr_scheduler.total_steps: must be >= 1 or unset (the schedule spans training.steps), got 0" in error_of(["--lr_scheduler.total_steps", "0"])
    assert load_config(["--validation.steps", "-1"]).validation.steps == -1
    assert ("validation.steps: must be >= 1 (batches per evaluation) or -1 (the whole validation split), got 0"
            in error_of(["--validation.steps", "0"]))


@pytest.mark.parametrize("name, fragment", [
    ("/tmp/config.toml", "leaves job.dump_folder"),
    ("../config.toml", "leaves job.dump_folder"),
    ("sub/../../config.toml", "leaves job.dump_folder"),
    ("metrics.jsonl", "is where the run writes metrics.jsonl itself"),
    ("run_meta.json", "is where the run writes run_meta.json itself"),
    ("checkpoint/config.toml", "is where the run writes checkpoint itself"),
    ("tb", "is where the run writes tb itself"),
    ("configs/", "is not a file name"),
])
def test_a_saved_config_file_stays_a_file_of_its_own_in_the_dump_folder(name, fragment):
    message = error_of(["--job.save_config_file", name])
    assert f"job.save_config_file: {name!r}" in message and fragment in message
    assert load_config(["--job.save_config_file", "configs/job.toml"]).job.save_config_file == "configs/job.toml"
    assert load_config(["--job.save_config_file", "job_config.json"]).job.save_config_file == "job_config.json"


# ---------------------------------------------------------------------------------------------
# Numbers: every float key refuses nan and +-inf, every numeric key its impossible values


def numeric_keys(kind: type) -> list[tuple[str, type, str]]:
    """(dotted key, section or table class, field name) of every `kind` key of the schema, found
    from the dataclasses themselves so that a new key is covered without editing this test. Keys
    of [[...]] tables are named "section.key[].field"."""
    found = []

    def scalar(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return scalar(args[0]) if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp

    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            tp = scalar(typing.get_type_hints(cls)[f.name])
            if tp is kind:
                found.append((f"{section}.{f.name}", cls, f.name))
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                entry = typing.get_args(tp)[0]
                found += [(f"{section}.{f.name}[].{g.name}", entry, g.name) for g in dataclasses.fields(entry)
                          if scalar(typing.get_type_hints(entry)[g.name]) is kind]
    return found


FLOAT_KEYS = [key for key, _, _ in numeric_keys(float)]


def test_the_schema_has_float_keys_in_sections_and_tables():
    assert {"optimizer.lr", "training.max_norm", "lr_scheduler.decay_ratio", "training.datasets[].weight",
            "activation_checkpoint.memory_budget"} <= set(FLOAT_KEYS)


def mixture_toml(weight: str) -> str:
    return f'[[training.datasets]]\npath = "/data/web"\nweight = {weight}\n'


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_a_value_that_is_not_finite(tmp_path, key, value):
    """From a TOML file and from the command line, one message naming the key, the value and
    what is valid: `optimizer.lr = inf` would train to a checkpoint of non-finite tensors,
    `training.max_norm = nan` would silently turn clipping off."""
    if "[]" in key:
        section, name = key.split("[].")
        messages = [error_of(["--job.config_file", write(tmp_path, mixture_toml(value))])]
        key = f"{section}[0].{name}"
    else:
        section, name = key.split(".")
        messages = [error_of(["--job.config_file", write(tmp_path, f"[{section}]\n{name} = {value}\n")]),
                    error_of([f"--{key}", value]), error_of([f"--{key}={value}"])]
    for message in messages:
        assert message.count(f"{key}: must be ") == 1, message
        assert f", got {value} (not a finite number)" in message, message


def test_every_numeric_key_declares_what_it_accepts():
    """A float key (and an int key) says which values are valid, in its field's metadata: the
    loader checks it, --help and docs/configuration.md show it."""
    from trainer.config.ranges import Valid

    undeclared = [key for kind in (float, int) for key, cls, name in numeric_keys(kind)
                  if not isinstance({f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("valid"), Valid)]
    assert undeclared == []


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer.lr", "-1e-3"], "optimizer.lr: must be in [0, 3.4e+38] (torch takes it as a float32, whose largest "
                                   "value is 3.4e38; 0 keeps the weights as they are), got -0.001"),
    (["--optimizer.eps", "0"], "optimizer.eps: must be in (0, 3.4e+38]"),
    (["--optimizer.beta1", "-0.1"], "optimizer.beta1: must be in [0, 1), got -0.1"),
    (["--optimizer.beta1", "1"], "optimizer.beta1: must be in [0, 1), got 1.0"),
    (["--optimizer.weight_decay", "-0.01"], "optimizer.weight_decay: must be in [0, 3.4e+38]"),
    (["--lr_scheduler.min_lr_factor", "1.5"], "lr_scheduler.min_lr_factor: must be in [0, 1], got 1.5"),
    (["--training.validation_fraction", "1"], "training.validation_fraction: must be in [0, 1)"),
    (["--training.validation_fraction", "-0.5"], "training.validation_fraction: must be in [0, 1)"),
    (["--activation_checkpoint.memory_budget", "1.5"], "activation_checkpoint.memory_budget: must be in [0, 1]"),
    (["--metrics.peak_flops", "-1"], "metrics.peak_flops: must be >= 0"),
    (["--debug.init_perturbation", "65"], "debug.init_perturbation: must be in [0, 64]"),
    (["--training.loss_scale_initial", "3"], "training.loss_scale_initial: must be a power of two"),
    (["--debug.seed", "-1"], "debug.seed: must be in [0, 4294967295], got -1"),
    (["--training.data_seed", "4294967296"], "training.data_seed: must be in [0, 4294967295]"),
    (["--comm.trace_buf_size", "-1"], "comm.trace_buf_size: must be >= 0"),
    (["--parallelism.tensor_parallel_sync_group", "-2"], "parallelism.tensor_parallel_sync_group: must be >= 0"),
    (["--parallelism.pipeline_parallel_first_stage_less_layers", "-1"],
     "parallelism.pipeline_parallel_first_stage_less_layers: must be >= 0"),
    (["--parallelism.pipeline_parallel_layers_per_stage", "0"],
     "parallelism.pipeline_parallel_layers_per_stage: must be >= 1"),
    (["--validation.local_batch_size", "0"], "validation.local_batch_size: must be >= 1"),
    (["--training.steps", "1" + "0" * 40], "training.steps: must be >= 1 and fit in 64 bits, got an integer of 133 bits"),
    (["--training.seq_len", "-" + "9" * 40], "training.seq_len: must be >= 2 and fit in 64 bits"),
])
def test_out_of_range_values_are_refused_naming_the_key_and_what_is_valid(argv, fragment):
    assert fragment in error_of(argv)


def test_out_of_range_values_from_toml(tmp_path):
    assert "training.datasets[0].weight: must be > 0, got 0.0" in error_of(
        ["--job.config_file", write(tmp_path, mixture_toml("0"))])
    huge = write(tmp_path, "[optimizer]\nlr = 1" + "0" * 400 + "\n", "huge.toml")
    assert "optimizer.lr: expected a number, got an integer too large for a float" in error_of(
        ["--job.config_file", huge])
    steps = write(tmp_path, f"[training]\nsteps = {2**63}\n", "steps.toml")
    assert "training.steps: must be >= 1 and fit in 64 bits, got 9223372036854775808" in error_of(
        ["--job.config_file", steps])


@pytest.mark.parametrize("argv, key, value", [
    (["--optimizer.lr", "0"], "optimizer.lr", 0.0),  # a run that checks what it loaded
    (["--training.max_norm", "0"], "training.max_norm", 0.0),  # documented: <= 0 turns clipping off
    (["--training.max_norm", "-1"], "training.max_norm", -1.0),
    (["--optimizer.beta1", "0"], "optimizer.beta1", 0.0),
    (["--optimizer.weight_decay", "0"], "optimizer.weight_decay", 0.0),
    (["--lr_scheduler.decay_ratio", "1"], "lr_scheduler.decay_ratio", 1.0),
    (["--lr_scheduler.min_lr_factor", "1"], "lr_scheduler.min_lr_factor", 1.0),
    (["--training.validation_fraction", "0"], "training.validation_fraction", 0.0),
    (["--debug.seed", "4294967295"], "debug.seed", 4294967295),
    (["--training.global_batch_size", "-1"], "training.global_batch_size", -1),
    (["--checkpoint.load_step", "-1"], "checkpoint.load_step", -1),
])
def test_the_edges_of_each_range_load(argv, key, value):
    section, name = key.split(".")
    assert getattr(getattr(load_config(argv), section), name) == value


def test_help_and_reference_show_what_each_number_accepts():
    lines = help_text().splitlines()
    assert lines[lines.index("  --optimizer.lr  (float, default 0.0008)") + 1] == "      valid: in [0, 3.4e+38]"
    assert lines[lines.index("  --optimizer.beta2  (float, default 0.95)") + 1] == "      valid: in [0, 1)"
    reference = (REPO / "docs" / "configuration.md").read_text()
    assert "| `lr` | float | in [0, 3.4e+38] | `0.0008` |" in reference
    assert "| `max_norm` | float | finite | `1.0` |" in reference


# ---------------------------------------------------------------------------------------------
# Floats torch takes as float32: refused at load beyond float32's range, not at the first step


@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.eps", "optimizer.weight_decay"])
def test_a_key_torch_takes_as_a_float32_is_refused_beyond_its_range(key):
    message = error_of([f"--{key}", "1e39"])
    assert f"{key}: must be in " in message and "torch takes it as a float32" in message and "got 1e+39" in message


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer.lr", "1e38"], "optimizer.lr: 1e+38 makes the first step's size lr / (1 - optimizer.beta1) = 1e+39"),
    (["--optimizer.lr", "2", "--optimizer.weight_decay", "3e38"], "optimizer.lr: 2 x optimizer.weight_decay 3e+38"),
])
def test_what_adam_computes_from_the_learning_rate_must_fit_in_float32_too(argv, fragment):
    assert fragment in error_of(argv)


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_adamw_steps_at_the_largest_accepted_learning_rate_and_not_beyond(implementation):
    """The checks stop where torch does: the largest lr they accept steps (the weights may
    overflow, which the trainer's non-finite check reports); 1e39 raised at the first step."""
    import torch

    from trainer.optim import build_optimizer

    largest = 3.4e38 * (1 - 0.9)  # the first step's size, lr / (1 - beta1), at float32's largest
    config = load_config(["--optimizer.lr", repr(largest), "--optimizer.implementation", implementation])
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = build_optimizer([("w", weight)], config.optimizer)
    weight.grad = torch.ones(4)
    optimizer.step()
    if implementation != "fused":  # torch's fused kernel takes the float without the check
        weight.grad = torch.ones(4)
        with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
            torch.optim.AdamW([weight], lr=1e39, foreach=implementation == "foreach").step()
