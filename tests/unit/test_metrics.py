"""Unit tests of trainer.metrics.step_log: arithmetic, metrics.jsonl, TensorBoard, device tables."""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.metrics import step_log
from trainer.config.job_config import JobConfig
from trainer.metrics.step_log import (
    PEAK_BF16_DENSE_FLOPS,
    MetricsLogger,
    StepFigures,
    memory_stats,
    peak_flops_per_device,
    should_log,
)

CPU = torch.device("cpu")


def make_config(tmp_path, **metrics_overrides) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "out")
    cfg.metrics.disable_color_printing = True
    for key, value in metrics_overrides.items():
        setattr(cfg.metrics, key, value)
    return cfg


def figures(step: int, loss: float = 5.0, **overrides) -> StepFigures:
    values = dict(step=step, loss=loss, grad_norm=1.5, lr=8e-4, tokens=8192,
                  tokens_seen=8192 * step, elapsed_s=2.0, steps_since_log=1)
    values.update(overrides)
    return StepFigures(**values)


def make_logger(cfg, **kwargs) -> MetricsLogger:
    args = dict(rank=0, is_log_rank=True, world_size=1, device=CPU, flops_per_token=1e9)
    args.update(kwargs)
    return MetricsLogger(cfg, **args)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- should_log
@pytest.mark.parametrize(
    "step, log_freq, total, expected",
    [
        (1, 10, 100, True),     # first step
        (2, 10, 100, False),
        (9, 10, 100, False),
        (10, 10, 100, True),    # multiple of log_freq
        (20, 10, 100, True),
        (25, 10, 100, False),
        (99, 10, 100, False),
        (100, 10, 100, True),   # last step, also a multiple
        (37, 10, 37, True),     # last step, not a multiple
        (36, 10, 37, False),
        (3, 1, 5, True),        # log_freq 1 logs every step
        (5, 0, 5, True),        # log_freq 0: first and last only
        (3, 0, 5, False),
    ],
)
def test_should_log(step, log_freq, total, expected):
    assert should_log(step, log_freq, total) is expected


# ---------------------------------------------------------------------------- arithmetic
def test_throughput_tflops_mfu_with_configured_peak(tmp_path):
    cfg = make_config(tmp_path, peak_flops=1e13)
    log = make_logger(cfg, world_size=2, flops_per_token=1e9)
    record = log.log_step(figures(10, tokens=8192, elapsed_s=2.0, steps_since_log=4))
    log.close()
    # 8192 tokens / 2 s / 2 devices = 2048 tokens/s per device
    assert record["tokens_per_s"] == pytest.approx(2048.0)
    # 1e9 FLOP/token * 2048 tokens/s = 2.048e12 FLOP/s = 2.048 TFLOPS
    assert record["tflops"] == pytest.approx(2.048)
    # 2.048e12 / 1e13 = 20.48 %
    assert record["mfu"] == pytest.approx(20.48)
    assert record["step_time_s"] == pytest.approx(0.5)
    assert record["tokens"] == 81920  # cumulative tokens_seen, not the window's tokens


def test_mfu_omitted_on_cpu_without_peak(tmp_path, caplog):
    cfg = make_config(tmp_path)  # peak_flops = 0
    log = make_logger(cfg, world_size=1, flops_per_token=3e8)
    with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
        record = log.log_step(figures(1, tokens=1000, elapsed_s=0.5))
    log.close()
    assert log.peak_flops is None
    assert record["mfu"] is None
    assert record["tokens_per_s"] == pytest.approx(2000.0)
    assert record["tflops"] == pytest.approx(3e8 * 2000 / 1e12)
    assert "mfu" not in caplog.text
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]["mfu"] is None


def test_zero_elapsed_gives_zero_throughput(tmp_path):
    log = make_logger(make_config(tmp_path, peak_flops=1e12))
    record = log.log_step(figures(1, elapsed_s=0.0, steps_since_log=0))
    log.close()
    assert record["tokens_per_s"] == 0.0 and record["tflops"] == 0.0 and record["mfu"] == 0.0
    assert record["step_time_s"] == 0.0


def test_console_line_plain_and_colored(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(step_log, "console_is_terminal", lambda: True)
    cfg = make_config(tmp_path, peak_flops=1e13)
    log = make_logger(cfg, world_size=1, flops_per_token=1e9)
    with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
        log.log_step(figures(10, loss=6.12341, grad_norm=1.23449, lr=8e-4,
                             tokens=24690, elapsed_s=2.0))
    log.close()
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 10")][0]
    mem = memory_stats(CPU)["peak_rss_gib"]
    assert re.fullmatch(
        r"step 10  loss 6\.1234  grad_norm 1\.2345  lr 8\.00e-04  tps 12,345  "
        r"tflops 12\.35  mfu 123\.45%  mem \d+\.\d\dGiB",
        line,
    ), line
    assert float(line.split("mem ")[1][:-3]) == pytest.approx(mem, abs=0.01)
    assert "\033[" not in line

    colored_cfg = make_config(tmp_path / "c", disable_color_printing=False)
    colored = make_logger(colored_cfg)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
        colored.log_step(figures(1))
    colored.close()
    assert any("\033[" in r.getMessage() and "loss 5.0000" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- metrics.jsonl
def test_jsonl_one_flushed_line_per_call(tmp_path):
    log = make_logger(make_config(tmp_path))
    path = tmp_path / "out" / "metrics.jsonl"
    for i, step in enumerate([1, 10, 20]):
        record = log.log_step(figures(step, loss=5.0 - step / 10))
        # readable from a separate handle before close: flushed every line
        lines = read_jsonl(path)
        assert len(lines) == i + 1
        assert lines[-1] == json.loads(json.dumps(record))
    log.close()

    lines = read_jsonl(path)
    assert [r["step"] for r in lines] == [1, 10, 20]
    assert [r["loss"] for r in lines] == pytest.approx([4.9, 4.0, 3.0])
    for r in lines:
        for key in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops",
                    "mfu", "memory", "time"):
            assert key in r, key
        assert r["memory"]["peak_rss_gib"] > 0
        assert abs(r["time"] - datetime.now().timestamp()) < 600
        assert r["grad_norm"] == 1.5 and r["lr"] == 8e-4


def test_appends_to_an_existing_file(tmp_path, caplog):
    """Which records of earlier starts stay is trainer.records.run_meta's decision; the logger appends."""
    cfg = make_config(tmp_path)
    first = make_logger(cfg)
    first.log_step(figures(1))
    first.log_step(figures(10))
    first.close()
    with caplog.at_level(logging.WARNING, logger="trainer.metrics.step_log"):
        resumed = make_logger(cfg)
    resumed.log_step(figures(20))
    resumed.close()
    out = tmp_path / "out"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 10, 20]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_resumed_tensorboard_continues_the_run_folder(tmp_path):
    """A resume from step 10 writes into the run's folder and hides the old events of steps > 10."""
    cfg = make_config(tmp_path, enable_tensorboard=True)
    first = make_logger(cfg, run_stamp="run1")
    for step, loss in ((1, 5.0), (10, 4.0), (11, 3.9), (12, 3.8)):
        first.log_step(figures(step, loss=loss))
    first.close()
    resumed = make_logger(cfg, run_stamp="run1", purge_step=11)
    resumed.log_step(figures(11, loss=3.0))
    resumed.close()
    assert [p.name for p in (tmp_path / "out" / "tb").iterdir()] == ["run1"]
    events = load_scalars(tmp_path / "out" / "tb" / "run1").Scalars("loss_metrics/global_avg_loss")
    assert [(e.step, e.value) for e in events] == [(1, 5.0), (10, 4.0), (11, 3.0)]


def test_non_log_rank_writes_nothing(tmp_path, caplog):
    cfg = make_config(tmp_path, enable_tensorboard=True, peak_flops=1e13)
    log = make_logger(cfg, rank=3, is_log_rank=False, world_size=4)
    with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
        record = log.log_step(figures(1, tokens=8000, elapsed_s=1.0))
    log.log_scalars(1, {"loss": 4.0}, "validation")
    log.close()
    assert record["tokens_per_s"] == pytest.approx(2000.0)
    assert record["mfu"] == pytest.approx(100 * 2e12 / 1e13)
    assert not (tmp_path / "out").exists()
    assert any(r.getMessage().startswith("step 1 ") for r in caplog.records)


def test_log_scalars_record_and_console(tmp_path, caplog):
    log = make_logger(make_config(tmp_path))
    log.log_step(figures(1))
    with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
        log.log_scalars(10, {"loss": 4.25, "perplexity": 70.1054}, prefix="validation")
    log.close()
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(records) == 2
    assert "kind" not in records[0]
    val = records[1]
    assert val["kind"] == "validation" and val["step"] == 10
    assert val["validation/loss"] == 4.25 and val["validation/perplexity"] == 70.1054
    assert "validation step 10  loss 4.2500  perplexity 70.1054" in caplog.text


def test_close_is_idempotent_and_final(tmp_path):
    log = make_logger(make_config(tmp_path))
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.log_step(figures(1))


# ---------------------------------------------------------------------------- TensorBoard
def load_scalars(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc


def test_tensorboard_events_read_back(tmp_path):
    cfg = make_config(tmp_path, enable_tensorboard=True, peak_flops=1e13)
    log = make_logger(cfg)
    losses = {1: 10.5, 10: 7.25, 20: 6.125}
    for step, loss in losses.items():
        log.log_step(figures(step, loss=loss))
    log.log_scalars(20, {"loss": 6.5}, prefix="validation")
    log.close()

    stamps = list((tmp_path / "out" / "tb").iterdir())
    assert len(stamps) == 1 and re.fullmatch(r"\d{8}-\d{6}", stamps[0].name)
    assert log.tb_dir == stamps[0]
    acc = load_scalars(stamps[0])
    tags = set(acc.Tags()["scalars"])
    assert {"loss_metrics/global_avg_loss", "grad_norm", "lr", "throughput/tps",
            "throughput/tflops", "throughput/mfu_pct", "memory/peak_rss_gib",
            "validation/loss"} <= tags
    events = acc.Scalars("loss_metrics/global_avg_loss")
    assert [e.step for e in events] == [1, 10, 20]
    assert [e.value for e in events] == pytest.approx(list(losses.values()))
    assert [e.value for e in acc.Scalars("throughput/tps")] == pytest.approx([4096.0] * 3)
    assert [e.value for e in acc.Scalars("throughput/mfu_pct")] == pytest.approx([40.96] * 3)
    assert acc.Scalars("validation/loss")[0].value == pytest.approx(6.5)


def test_tensorboard_readable_before_close(tmp_path):
    log = make_logger(make_config(tmp_path, enable_tensorboard=True))
    log.log_step(figures(1, loss=3.5))
    acc = load_scalars(log.tb_dir)
    assert [e.value for e in acc.Scalars("loss_metrics/global_avg_loss")] == [3.5]
    assert "throughput/mfu_pct" not in acc.Tags()["scalars"]  # mfu unknown on CPU
    log.close()


def test_tensorboard_all_ranks_and_disabled(tmp_path):
    cfg = make_config(tmp_path, enable_tensorboard=True, save_for_all_ranks=True,
                      save_tb_folder="events")
    loggers = [make_logger(cfg, rank=r, is_log_rank=(r == 0), world_size=2, run_stamp="run1")
               for r in (0, 1)]
    for r, log in enumerate(loggers):
        log.log_step(figures(1, loss=2.0 + r))
        log.close()
    run = tmp_path / "out" / "events" / "run1"
    assert sorted(p.name for p in run.iterdir()) == ["rank_0", "rank_1"]
    for r in (0, 1):
        acc = load_scalars(run / f"rank_{r}")
        assert acc.Scalars("loss_metrics/global_avg_loss")[0].value == pytest.approx(2.0 + r)
    assert [rec["loss"] for rec in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [2.0]

    off = make_logger(make_config(tmp_path / "off"))  # enable_tensorboard defaults to False
    off.log_step(figures(1))
    off.close()
    assert off.tb_dir is None
    assert sorted(p.name for p in (tmp_path / "off" / "out").iterdir()) == ["metrics.jsonl"]


# ---------------------------------------------------------------------------- devices
def test_memory_stats_cpu_positive():
    stats = memory_stats(CPU)
    assert set(stats) == {"peak_rss_gib"}
    assert 0 < stats["peak_rss_gib"] < 1024


def test_memory_stats_cuda_uses_allocator_peaks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**29)
    assert memory_stats(torch.device("cuda", 0)) == {"max_allocated_gib": 3.0,
                                                     "max_reserved_gib": 2.5}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("AMD Instinct MI300X", 1307e12),
    ],
)
def test_peak_flops_table_lookup(monkeypatch, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops_per_device(torch.device("cuda", 0), 0.0) == expected


def test_peak_flops_unknown_cpu_and_configured(monkeypatch, caplog):
    name = "Imaginary Accelerator X1 (test_metrics)"
    step_log._warned_unknown_devices.discard(name)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="trainer.metrics.step_log"):
        assert peak_flops_per_device(cuda, 0.0) is None
        assert peak_flops_per_device(cuda, 0.0) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and name in warnings[0].getMessage()

    assert peak_flops_per_device(cuda, 123e12) == 123e12  # configured wins over lookup
    assert peak_flops_per_device(CPU, 0.0) is None
    assert peak_flops_per_device(CPU, 5e11) == 5e11


def test_peak_table_specific_names_first():
    keys = list(PEAK_BF16_DENSE_FLOPS)
    for i, general in enumerate(keys):
        for specific in keys[i + 1:]:
            assert general.upper() not in specific.upper(), (
                f"{general!r} precedes the more specific {specific!r} and would shadow it")


def test_colors_only_on_a_terminal(tmp_path, monkeypatch, caplog):
    """A rank's output goes to a log file under the launcher: no ANSI codes there."""
    cfg = make_config(tmp_path, disable_color_printing=False)
    for tty, colored in ((False, False), (True, True)):
        monkeypatch.setattr(step_log, "console_is_terminal", lambda: tty)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainer.metrics.step_log"):
            log = make_logger(cfg)
            log.log_step(figures(1))
            log.close()
        assert any("\033[" in r.getMessage() for r in caplog.records) is colored
