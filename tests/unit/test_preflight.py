"""Parallel degrees and batch split, checked before any process starts."""

from __future__ import annotations

import pytest

from trainer.config.job_config import Parallelism
from trainer.config.manager import ConfigError, load_config
from trainer.parallel.dims import ParallelDims
from trainer.preflight.checks import plan_run


def test_shard_degree_minus_one_takes_the_rest():
    dims = ParallelDims.from_config(Parallelism(), 4)
    assert (dims.dp_shard, dims.dp, dims.fsdp_enabled) == (4, 4, True)
    assert dims.degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree=3 .* 3 processes, but the world size is 4"):
        ParallelDims.from_config(Parallelism(data_parallel_shard_degree=3), 4)
    with pytest.raises(ConfigError, match="world size 3 is not divisible .*tensor_parallel_degree=2"):
        ParallelDims.from_config(Parallelism(tensor_parallel_degree=2), 3)


def test_world_product_with_other_degrees():
    dims = ParallelDims.from_config(Parallelism(tensor_parallel_degree=2, pipeline_parallel_degree=2), 8)
    assert (dims.dp_shard, dims.tp, dims.pp, dims.dp) == (2, 2, 2, 2)


def test_batch_split_and_accumulation():
    plan = plan_run(load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "8"]), 2)
    assert (plan.global_batch_size, plan.accumulation_steps) == (8, 2)
    plan = plan_run(load_config(["--training.local_batch_size", "4"]), 2)
    assert (plan.global_batch_size, plan.accumulation_steps) == (8, 1)


def test_global_batch_not_a_multiple():
    with pytest.raises(ConfigError, match=r"training.global_batch_size: 6 is not a multiple of .* = 4"):
        plan_run(load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "6"]), 2)


def test_a_missing_hf_assets_folder_is_refused_by_name():
    config = load_config(["--model.hf_assets_path", "/some/folder"])  # a config may name it (print_config)
    with pytest.raises(ConfigError, match="model.hf_assets_path: /some/folder is not a folder"):
        plan_run(config, 1)
    with pytest.raises(ConfigError, match='model.flavor = "hf" takes the shapes from model.hf_assets_path'):
        load_config(["--model.flavor", "hf"])


def test_a_config_json_the_flavor_ignores_is_mentioned(tmp_path, caplog):
    import json
    import logging

    from trainer.models.llama3 import get_flavor
    from trainer.models.llama3.hf_config import hf_config
    from trainer.preflight.checks import say_unused_hf_shapes

    (tmp_path / "config.json").write_text(json.dumps(hf_config(get_flavor("tiny"))))
    with caplog.at_level(logging.WARNING):
        say_unused_hf_shapes(load_config(["--model.flavor", "tiny", "--model.hf_assets_path", str(tmp_path)]))
        assert not caplog.records  # the same shapes: nothing to say
        say_unused_hf_shapes(load_config(["--model.hf_assets_path", str(tmp_path)]))
    [record] = caplog.records
    assert "the shapes of model.flavor debugmodel are used, not those of its config.json" in record.getMessage()
    assert "hidden_size = 64 (the configured model has 256)" in record.getMessage()


# ---------------------------------------------------------------------------------------------
# validation.steps = -1 and training.dtype


WHOLE = ["--validation.enable", "--validation.steps", "-1"]


@pytest.mark.parametrize("argv, fragment", [
    ([], "validation.steps: -1 (the whole validation split) needs a split of known length ('shards', 'files', "
         "'c4_test', 'python_stdlib'), but the validation data 'synthetic' is an endless stream; set validation.steps to a number of "
         "batches (e.g. 10)"),
    (["--training.dataset", "c4"], "the validation data 'c4' is streamed, so its length is known only once it has "
                                   "been read; set validation.steps to a number of batches"),
    (["--validation.dataset", "org/corpus"], "the validation data 'org/corpus' is streamed"),
])
def test_the_whole_validation_split_needs_one_of_known_length(argv, fragment):
    with pytest.raises(ConfigError) as info:
        plan_run(load_config(["--model.tokenizer_path", "", *WHOLE, *argv]), 1)
    assert fragment in str(info.value)


def test_the_whole_split_of_a_mixture_is_refused(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[[training.datasets]]\npath = "/data/a"\n[[training.datasets]]\npath = "/data/b"\n')
    with pytest.raises(ConfigError, match=r"validation.steps: -1 \(the whole validation split\) is not defined for a "
                                          r"\[\[training.datasets\]\] mixture"):
        plan_run(load_config(["--job.config_file", str(path), *WHOLE]), 1)


def test_the_whole_split_is_only_checked_when_validating():
    plan_run(load_config(["--validation.steps", "-1"]), 1)  # torchtitan's default, validation off: fine


def test_bfloat16_state_halves_the_host_memory_need():
    from trainer.preflight.checks import training_memory_need

    def need(*argv):
        config = load_config(["--model.flavor", "debugmodel", *argv])
        return training_memory_need(config, plan_run(config, 2).dims, "cpu", 2)

    float32, bfloat16 = need(), need("--training.dtype", "bfloat16")
    assert "Adam state in bfloat16 (" in bfloat16.what and "x 8 bytes" in bfloat16.what
    # 2 of 2 processes hold one whole model state: 16 bytes a parameter in float32, 8 in bfloat16
    # (the init buffers, drawn in float32 either way, are the same), and each its step's
    # activations, computed in the training dtype.
    activations = 2 * (float32.activations.bytes - bfloat16.activations.bytes)
    assert float32.bytes - bfloat16.bytes - activations == (16 - 8) * count_parameters("debugmodel")


def count_parameters(flavor: str) -> int:
    from trainer.models.llama3.args import get_flavor, num_params

    return num_params(get_flavor(flavor))
