"""A run described from its own record: layout (degrees and the options that differ from the
control's), code versions."""

from __future__ import annotations

from protocol.plan.records import config_changes, describe_changes
from protocol.verdict.run_info import RunInfo, code_summary, layout, run_info

CONTROL_CONFIG = {
    "job": {"dump_folder": "/out/control", "config_file": "/repo/train_configs/debug_model.toml"},
    "optimizer": {"lr": 0.003},
    "parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
                    "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1},
    "checkpoint": {"initial_load_path": "/out/seed/checkpoint/step-0"},
    "debug": {"seed": 0},
}
DEGREES = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}


def record(config_changes: dict, degrees: dict | None = None, **fields) -> dict:
    config = {section: dict(values) for section, values in CONTROL_CONFIG.items()}
    for key, value in config_changes.items():
        section, name = key.split(".")
        config.setdefault(section, {})[name] = value
    return {"config": config, "degrees": {**DEGREES, **(degrees or {})}, **fields}


def test_layout_is_the_recorded_degrees_and_the_options_that_differ_from_the_control():
    control = record({})
    pp = record({"job.dump_folder": "/out/pp", "debug.seed": 1, "parallelism.pipeline_parallel_degree": 2,
                 "parallelism.tensor_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
                 "parallelism.pipeline_parallel_microbatch_size": 2},
                degrees={"pp": 2, "tp": 2})
    assert layout(pp, control) == ("dp_shard 2, tp 2, pp 2 (Interleaved1F1B) + "
                                   "parallelism.pipeline_parallel_microbatch_size=2")
    assert layout(record({"optimizer.lr": 0.006}), control) == "dp_shard 2 + optimizer.lr=0.006"
    assert layout(control, control) == "dp_shard 2"
    assert layout(record({"compile.enable": True}), None) == "dp_shard 2"  # no control record: degrees only


def test_an_option_only_the_control_sets_shows_as_unset():
    control = record({"compile.enable": True})
    assert layout(record({}), control) == "dp_shard 2 + compile.enable=unset"


def test_changes_in_words():
    changes = config_changes({"a": {"x": 1, "y": [1, 2], "z": ""}}, {"a": {"x": 2, "y": (1, 2), "w": True}})
    assert describe_changes(changes) == ["a.x 1 -> 2", "a.w unset -> true", "a.z '' -> unset"]
    many = config_changes({"a": {str(i): i for i in range(10)}}, {"a": {str(i): i + 1 for i in range(10)}})
    assert describe_changes(many)[-1] == "and 2 more options" and len(describe_changes(many)) == 9


def test_run_info_and_code_summary():
    code = {"commit": "3f2a1c9d" + "0" * 32, "dirty": True, "source_sha256": "a" * 64}
    info = run_info("tp2", "/out/tp2", record({}, last_step=20, status="completed", code=code, torch="2.13.0",
                                              world_size=4), None)
    assert (info.steps, info.status, info.code, info.torch, info.world_size) == (
        20, "completed", "3f2a1c9d (with local changes)", "2.13.0", 4)
    missing = run_info("pp2", "/out/pp2", None, None)
    assert missing.layout == "not recorded (no run_meta.json)" and not missing.recorded
    assert code_summary([info]) == "3f2a1c9d (with local changes) (every run)"
    other = RunInfo("cp2", "/out/cp2", "dp_shard 2", code="8b0e44aa")
    assert code_summary([info, other, missing]) == ("3f2a1c9d (with local changes) (tp2); 8b0e44aa (cp2); "
                                                    "not recorded (pp2)")
    assert code_summary([missing]) is None
