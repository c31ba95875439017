"""Parallel degrees and batch split, checked before any process starts."""

from __future__ import annotations

import pytest

from trainer.config.job_config import Parallelism
from trainer.config.manager import ConfigError, load_config
from trainer.parallel.dims import ParallelDims
from trainer.preflight import plan_run


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
    with pytest.raises(ConfigError, match="model.hf_assets_path: /some/folder is not a folder"):
        load_config(["--model.hf_assets_path", "/some/folder"])
    with pytest.raises(ConfigError, match='model.flavor = "hf" takes the shapes from model.hf_assets_path'):
        load_config(["--model.flavor", "hf"])


def test_a_config_json_the_flavor_ignores_is_mentioned(tmp_path, caplog):
    import json
    import logging

    from trainer.models.llama3 import get_flavor
    from trainer.models.llama3.hf_config import hf_config
    from trainer.preflight import say_unused_hf_shapes

    (tmp_path / "config.json").write_text(json.dumps(hf_config(get_flavor("tiny"))))
    with caplog.at_level(logging.WARNING):
        say_unused_hf_shapes(load_config(["--model.flavor", "tiny", "--model.hf_assets_path", str(tmp_path)]))
        assert not caplog.records  # the same shapes: nothing to say
        say_unused_hf_shapes(load_config(["--model.hf_assets_path", str(tmp_path)]))
    [record] = caplog.records
    assert "the shapes of model.flavor debugmodel are used, not those of its config.json" in record.getMessage()
    assert "hidden_size = 64 (the configured model has 256)" in record.getMessage()
