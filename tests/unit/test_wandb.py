"""metrics.enable_wandb: the W&B writer (offline runs read back from their .wandb file) and the
launcher-side check for the optional package."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError, load_config
from trainer.metrics.step_log import MetricsLogger, StepFigures
from trainer.preflight.checks import main as preflight_main
from trainer.preflight.checks import plan_run

# The .wandb file: a 7-byte header (":W&B", magic, version), then a LevelDB-style log of 32 KiB
# blocks; each protobuf Record is written as chunks with a 7-byte header (CRC, length, type).
WANDB_BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", CHUNK_HEADER
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = WANDB_BLOCK - pos % WANDB_BLOCK
        if left_in_block < CHUNK_HEADER:  # the writer pads a block's tail that cannot hold a header
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"{path}: chunk type {kind} at byte {pos}"
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            records.append(Record.FromString(pending))
            pending = b""
    return records


def offline_runs(dump_folder: Path) -> list[Path]:
    """The .wandb files of the offline runs written under dump_folder."""
    return sorted((dump_folder / "wandb").glob("offline-run-*/run-*.wandb"))


def read_run(path: Path) -> dict:
    """{"history": {step: {tag: value}}, "config": {section: {...}}, "project", "name", "group",
    "exit_code"} of one offline run."""
    run: dict = {"history": {}, "exit_code": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].setdefault(record.history.step.num, {}).update(row)
        elif kind == "run":
            run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run["project"], run["name"], run["group"] = (record.run.project, record.run.display_name,
                                                         record.run.run_group)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


@pytest.fixture
def offline(monkeypatch):
    """W&B without network or account; the project from WANDB_PROJECT."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                        "WANDB_DISABLE_CODE": "true", "WANDB_PROJECT": "unit-test-project"}.items():
        monkeypatch.setenv(name, value)


def make_logger(tmp_path, **metrics) -> MetricsLogger:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.disable_color_printing = True
    cfg.metrics.enable_wandb = True
    for key, value in metrics.items():
        setattr(cfg.metrics, key, value)
    return MetricsLogger(cfg, rank=0, is_log_rank=True, world_size=1, device=torch.device("cpu"),
                         flops_per_token=1e6, run_stamp="20250101-000000")


def figures(step: int, loss: float) -> StepFigures:
    return StepFigures(step=step, loss=loss, grad_norm=0.5 * step, lr=1e-3 * step, tokens=4096, tokens_seen=4096 * step,
                       elapsed_s=2.0, steps_since_log=1)


def test_the_offline_run_has_the_tensorboard_tags_at_the_same_steps(tmp_path, offline):
    log = make_logger(tmp_path, enable_tensorboard=True)
    records = [log.log_step(figures(step, loss)) for step, loss in ((1, 6.5), (2, 6.25), (4, 5.75))]
    log.log_scalars(4, {"loss": 5.5}, prefix="validation")
    log.close()

    (path,) = offline_runs(tmp_path)
    run = read_run(path)
    assert sorted(run["history"]) == [1, 2, 4]
    for record in records:
        row = run["history"][record["step"]]
        assert row["loss_metrics/global_avg_loss"] == record["loss"]
        assert row["grad_norm"] == record["grad_norm"]
        assert row["lr"] == record["lr"]
        assert row["throughput/tps"] == pytest.approx(record["tokens_per_s"])  # 4096 tokens / 2 s
        assert row["throughput/tps"] == 2048
        assert row["memory/peak_rss_gib"] == record["memory"]["peak_rss_gib"]
    assert run["history"][4]["validation/loss"] == 5.5
    assert "throughput/mfu_pct" not in run["history"][1]  # unknown on a CPU: left out, as in TensorBoard

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log.tb_dir))
    events.Reload()
    logged = {tag for row in run["history"].values() for tag in row if not tag.startswith("_")}
    assert logged == set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss_metrics/global_avg_loss")] == [1, 2, 4]

    assert run["project"] == "unit-test-project"
    assert run["config"]["metrics"]["enable_wandb"] is True  # the resolved job config
    assert run["config"]["job"]["dump_folder"] == str(tmp_path)
    assert run["exit_code"] == 0


def test_a_failed_run_is_marked_failed_and_a_default_project_is_used(tmp_path, offline, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT")
    log = make_logger(tmp_path)
    log.log_step(figures(1, 6.0))
    log.close(failed=True)
    run = read_run(offline_runs(tmp_path)[0])
    assert run["exit_code"] == 1
    assert run["project"] == "llama-pretrain"


def test_every_rank_writes_its_own_run_in_one_group_with_save_for_all_ranks(tmp_path, offline):
    for rank in (0, 1):
        cfg = JobConfig()
        cfg.job.dump_folder = str(tmp_path)
        cfg.metrics.enable_wandb = cfg.metrics.save_for_all_ranks = True
        log = MetricsLogger(cfg, rank=rank, is_log_rank=rank == 0, world_size=1, device=torch.device("cpu"),
                            flops_per_token=1e6, run_stamp="20250101-000000")
        log.log_step(figures(1, 6.0 + rank))
        log.close()
    runs = [read_run(path) for path in offline_runs(tmp_path)]
    assert sorted(run["name"] for run in runs) == ["rank_0", "rank_1"]
    assert {run["group"] for run in runs} == {"20250101-000000"}


def test_only_the_log_rank_writes_by_default(tmp_path, offline):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.enable_wandb = True
    log = MetricsLogger(cfg, rank=1, is_log_rank=False, world_size=2, device=torch.device("cpu"), flops_per_token=1e6)
    log.log_step(figures(1, 6.0))
    log.close()
    assert not (tmp_path / "wandb").exists()


def test_a_run_wandb_cannot_start_names_the_key_and_offline_mode(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as error:
        make_logger(tmp_path)
    message = str(error.value)
    assert message.startswith("metrics.enable_wandb:") and "api_key not configured" in message
    assert "WANDB_MODE=offline" in message and "wandb sync" in message


# ---------------------------------------------------------------------------- missing package
def test_a_missing_wandb_package_is_one_error_before_the_launch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib sees when the package is absent
    config = load_config(["--metrics.enable_wandb"])
    with pytest.raises(ConfigError) as error:
        plan_run(config, 1)
    assert str(error.value) == (
        f"metrics.enable_wandb: the wandb package is not installed in {sys.executable}; install it from the "
        f"repository root with {sys.executable} -m pip install -e '.[wandb]', or turn metrics.enable_wandb off")

    assert preflight_main(["--nproc", "2", "--device", "cpu", "--metrics.enable_wandb"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{sys.executable} -m pip install -e '.[wandb]'" in err

    plan_run(load_config(["--metrics.no_enable_wandb"]), 1)  # not needed when off
