"""torchtitan's configs and flags: ignored options in a TOML file and on the command line alike,
and the "Coming from torchtitan" table of every torchtitan v0.2.2 key."""

from __future__ import annotations

import logging
import textwrap

import pytest

from trainer.config.torchtitan_keys import IGNORED_KEYS, IGNORED_SECTIONS
from trainer.config.manager import ConfigError, load_config, with_default_config
from trainer.config.torchtitan_keys import (
    DIFFERENT,
    IGNORED,
    OWN_KEYS,
    REFUSED,
    REFUSED_STATUS,
    SAME,
    TORCHTITAN_KEYS,
    schema_keys,
    status,
    table,
)

def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_ignored_options_on_the_command_line_are_accepted_and_named_once(caplog):
    argv = ["--quantize.linear.mx.filter_fqns", "output", "--quantize.grouped_mm.float8.fqns", "experts",
            "--activation_checkpoint.early_stop", "--training.steps", "3", "--activation_checkpoint.no_early_stop",
            "--training.gc_debug=true", "--parallelism.expert_parallel_degree", "1",
            "--float8.emulate", "true", "--checkpoint.enable_ft_dataloader_checkpoints"]
    with caplog.at_level(logging.WARNING):
        config = load_config(argv)
    assert config.training.steps == 3  # the options around them still apply
    assert config == load_config(["--training.steps", "3"])  # and the ignored ones change nothing
    [warning] = warnings_of(caplog)
    assert warning.startswith("ignoring options this trainer does not implement (torchtitan's; docs/configuration.md "
                              "lists them): command line: ")
    names = warning.split("command line: ")[1].split(", ")
    assert names == ["--quantize.linear.mx.filter_fqns", "--quantize.grouped_mm.float8.fqns",
                     "--activation_checkpoint.early_stop", "--training.gc_debug",
                     "--parallelism.expert_parallel_degree", "--float8.emulate",
                     "--checkpoint.enable_ft_dataloader_checkpoints"]


def test_a_toml_file_and_the_command_line_share_one_warning(tmp_path, caplog):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent("""
        [quantize.linear.mx]
        filter_fqns = ["output"]
        [activation_checkpoint]
        visualize_memory_budget_pareto = true
        [training]
        steps = 4
    """))
    with caplog.at_level(logging.WARNING):
        config = load_config(["--job.config_file", str(path), "--training.gc_debug=true"])
    assert config.training.steps == 4
    [warning] = warnings_of(caplog)
    assert (f"{path}: quantize.linear.mx, activation_checkpoint.visualize_memory_budget_pareto; command line: "
            "--training.gc_debug") in warning


@pytest.mark.parametrize("argv, message", [
    (["--model.convertors", "float8"], "unknown key model.convertors; did you mean 'converters'?"),
    (["--quantise.linear.float8.emulate"], "unknown section 'quantise'; did you mean 'quantize'?"),
    (["--activation_checkpoint.preserve_rng_state", "false"], "unknown key activation_checkpoint.preserve_rng_state"),
    (["--training.steps", "three"], "argument --training.steps: expected an integer, got 'three'"),
    (["--debug.seed", "1.5"], "argument --debug.seed: expected an integer, got '1.5'"),
])
def test_options_that_are_not_torchtitans_ignored_ones_are_refused_as_before(argv, message):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert message in str(info.value)


def test_a_refused_torchtitan_key_says_why_on_the_command_line_and_in_a_file(tmp_path):
    why = "torchtitan's option, refused here: the model draws no random numbers, so recomputation needs no saved RNG state"
    with pytest.raises(ConfigError, match=why):
        load_config(["--activation_checkpoint.preserve_rng_state", "false"])
    path = tmp_path / "job.toml"
    path.write_text('[comm]\nmode = "fake_backend"\n')
    with pytest.raises(ConfigError, match=f"{path}: unknown key comm.mode: torchtitan's option, refused here: only "
                                          "real communication"):
        load_config(["--job.config_file", str(path)])


def test_an_ignored_bare_flag_does_not_swallow_the_next_option():
    config = load_config(["--activation_checkpoint.early_stop", "--training.steps", "5", "--model.print_after_conversion"])
    assert config.training.steps == 5


def test_every_torchtitan_key_has_exactly_one_status():
    rows = table()
    assert len(rows) == sum(len(keys) for keys in TORCHTITAN_KEYS.values()) == 149
    counts = {state: sum(1 for _, s, _ in rows if s == state) for state in (SAME, "different", IGNORED, REFUSED_STATUS)}
    assert sum(counts.values()) == 149
    for key, state, note in rows:
        assert bool(note) == (state != SAME), key  # a difference, a refusal and an ignored key say why


def test_the_table_lists_every_torchtitan_key_this_trainer_knows_of():
    listed = {f"{section}.{key}" for section, keys in TORCHTITAN_KEYS.items() for key in keys}
    # Every schema key is torchtitan's (listed) or this trainer's own; none is both.
    assert schema_keys() == (schema_keys() & listed) | set(OWN_KEYS)
    assert not listed & set(OWN_KEYS)
    # Every ignored key of a torchtitan v0.2.2 section is one of its keys or of an earlier version's.
    earlier = {"job.print_args", "job.use_for_integration_test", "parallelism.enable_compiled_autograd",
               "parallelism.pipeline_parallel_split_points"}
    for section, keys in IGNORED_KEYS.items():
        for key in keys:  # a key, or a table of keys (training.dataloader, quantize.linear.mx)
            assert (f"{section}.{key}" in earlier or any(name == key or name.startswith(f"{key}.")
                                                         for name in TORCHTITAN_KEYS[section])), f"{section}.{key}"
    assert set(IGNORED_SECTIONS) - set(TORCHTITAN_KEYS) == {"float8", "mx"}  # torchtitan v0.1's
    # No key is both implemented and ignored (implementing one means taking it out of ignored.py).
    ignored = {f"{section}.{key}" for section, keys in IGNORED_KEYS.items() for key in keys}
    assert not ignored & schema_keys() and not set(IGNORED_SECTIONS) & {key.split(".")[0] for key in schema_keys()}
    # The notes name listed keys only, and no key is both implemented and refused.
    assert set(DIFFERENT) <= listed & schema_keys() and set(REFUSED) <= listed - schema_keys()


def test_statuses_of_the_keys_this_work_touches():
    assert status("training.dtype")[0] == "different"
    assert status("lr_scheduler.total_steps")[0] == "different"
    assert status("job.save_config_file")[0] == "different"
    assert status("activation_checkpoint.visualize_memory_budget_pareto") == (
        IGNORED, "the memory budget's trade-off plot is not implemented")
    assert status("activation_checkpoint.memory_budget") == (SAME, "")
    assert status("quantize.linear.float8.recipe_name") == (SAME, "")
    assert status("quantize.linear.float8.filter_fqns")[0] == "different"  # the output layer stays high precision
    assert status("model.converters")[0] == "different"  # float8 only, under either of its names
    assert status("quantize.linear.mx.recipe_name") == (IGNORED, "MX formats (MXFP8, for Blackwell GPUs) are not "
                                                                 "implemented")
    assert status("quantize.grouped_mm.float8.fqns") == (IGNORED, "MoE's grouped matmuls: no effect on a Llama model")
    assert status("fault_tolerance.enable")[1].startswith("torchft's replica groups")  # a section's reason
    assert status("compile.enable") == (SAME, "")
    assert status("comm.mode")[0] == REFUSED_STATUS
    with pytest.raises(KeyError, match="has no status"):
        status("compile.fullgraph")


def test_a_torchtitan_style_config_loads_with_its_flags(tmp_path, caplog):
    """A config written in torchtitan v0.2.2's format, with the keys its Llama 3 configs set, and a
    launch line's torchtitan flags: it trains here as it is, its ignored options named once."""
    path = tmp_path / "torchtitan.toml"
    path.write_text(textwrap.dedent("""
        [job]
        dump_folder = "./outputs"
        description = "from torchtitan"
        print_config = false
        save_config_file = "job_config.toml"
        [profiling]
        enable_profiling = false
        save_traces_folder = "profile_trace"
        profile_freq = 10
        [metrics]
        log_freq = 1
        disable_color_printing = false
        enable_tensorboard = false
        save_tb_folder = "tb"
        [model]
        name = "llama3"
        flavor = "debugmodel"
        converters = []
        [optimizer]
        name = "AdamW"
        lr = 8e-4
        eps = 1e-8
        [lr_scheduler]
        warmup_steps = 2
        total_steps = 20
        decay_ratio = 0.8
        decay_type = "linear"
        min_lr_factor = 0.0
        [training]
        local_batch_size = 8
        seq_len = 2048
        max_norm = 1.0
        steps = 10
        dtype = "bfloat16"
        mixed_precision_param = "bfloat16"
        [training.dataloader]
        num_workers = 2
        [parallelism]
        data_parallel_replicate_degree = 1
        data_parallel_shard_degree = -1
        fsdp_reshard_after_forward = "default"
        tensor_parallel_degree = 1
        pipeline_parallel_degree = 1
        pipeline_parallel_schedule = "Interleaved1F1B"
        context_parallel_degree = 1
        [checkpoint]
        enable = false
        folder = "checkpoint"
        interval = 10
        last_save_model_only = false
        export_dtype = "float32"
        async_mode = "disabled"
        [activation_checkpoint]
        mode = "selective"
        selective_ac_option = "2"
        [compile]
        enable = false
        components = ["model", "loss"]
        [quantize.linear.float8]
        enable_fsdp_float8_all_gather = false
        filter_fqns = ["output"]
        [validation]
        enable = false
        freq = 5
        steps = -1
    """))
    with caplog.at_level(logging.WARNING):
        config = load_config(with_default_config(["--job.config_file", str(path),
                                                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                                                  "--training.steps", "12"]))
    assert (config.training.steps, config.lr_scheduler.total_steps, config.training.dtype) == (12, 20, "bfloat16")
    assert (config.validation.steps, config.job.save_config_file) == (-1, "job_config.toml")
    assert warnings_of(caplog) == []  # every key of it is implemented
    assert config.training.dataloader.num_workers == 2
    float8 = config.quantize.linear.float8  # read, though model.converters = [] leaves float8 off
    assert (float8.filter_fqns, float8.precompute_float8_dynamic_scale_for_fsdp) == (["output"], True)
    assert config.model.converters == []
