"""Training on the built-in python_stdlib corpus through the launcher, from an empty cache."""

from __future__ import annotations

import json
import time

from tests.launch import describe, launch, read_metrics
from trainer.data import python_corpus


def test_a_tiny_model_learns_the_standard_library_through_the_launcher(tmp_path, monkeypatch, measured):
    """The launcher prepares the corpus once, before the ranks start (its own console line, not
    a rank's), and the loss of 10 steps falls."""
    monkeypatch.setenv(python_corpus.CACHE_ENV, str(tmp_path / "cache"))
    started = time.perf_counter()
    result = launch(1, [
        "--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "10", "--training.dataset",
        "python_stdlib", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--metrics.no_enable_tensorboard", "--validation.enable", "--validation.freq", "10", "--validation.steps", "2",
        "--job.dump_folder", str(tmp_path / "run"),
    ])
    seconds = time.perf_counter() - started
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    preparing = [i for i, line in enumerate(lines) if line.startswith("preparing the python_stdlib corpus")]
    assert len(preparing) == 1 and preparing[0] < next(i for i, line in enumerate(lines) if line.startswith("outputs:"))
    train = [r for r in read_metrics(tmp_path / "run") if "kind" not in r]
    validation = [r for r in read_metrics(tmp_path / "run") if r.get("kind") == "validation"]
    first, last = train[0]["loss"], train[-1]["loss"]
    measured(f"python_stdlib, tiny model, 10 steps of 8 x 64 tokens through the launcher (preparing the corpus "
             f"included): loss {first:.3f} -> {last:.3f}, validation {validation[-1]['validation/loss']:.3f}; "
             f"{seconds:.0f} s")
    assert len(train) == 10 and last < first - 0.3
    record = json.loads((tmp_path / "run" / "run_meta.json").read_text())
    assert record["data"]["source"] == "python_stdlib:train" and record["data"]["python"].startswith("CPython")
    assert record["validation_data"]["source"] == "python_stdlib:validation"
