"""Fixtures of the protocol tests: a small plan, and a fake launcher that writes what real runs write
(tests/protocol/fake_trainer.py) with fixed code and torch versions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from protocol.plan.load import load_plan
from protocol.plan.model import REPO_ROOT
from protocol.run.reuse import Now
from tests.protocol.fake_trainer import FAKE_CODE, FAKE_TORCH

SMALL_PLAN = """
[plan]
name = "small"
config = "debug_model.toml"
output = "{output}"
steps = {steps}
local_batch_size = 4
dp_degree = 2
gpus_per_node = {gpus_per_node}
overrides = {{ "model.flavor" = "{flavor}", "training.seq_len" = 32, "optimizer.lr" = 3e-3 }}

[tolerance]
mode = "exact"

[[sets]]
name = "FSDP+TP2"
kind = "parallelism"
tp = 2

[[sets]]
name = "lr x2"
kind = "technique"
overrides = {{ "optimizer.lr" = {lr} }}
"""


@pytest.fixture
def software(monkeypatch):
    """The code and torch versions a run started now would record, as the protocol sees them;
    `software(code=..., torch=...)` changes them (a trainer edit, another torch)."""
    import protocol.run.reuse

    def set_now(code: dict = FAKE_CODE, torch: str = FAKE_TORCH) -> None:
        monkeypatch.setattr(protocol.run.reuse, "current", lambda: Now(code=code, torch=torch))

    set_now()
    monkeypatch.setenv("FAKE_CODE", json.dumps(FAKE_CODE))
    monkeypatch.setenv("FAKE_TORCH", FAKE_TORCH)
    return set_now


@pytest.fixture
def small_plan(tmp_path, software):
    """small_plan(**changes) writes plan.toml (steps 3, tiny model, lr x2 at 6e-3) and loads it;
    calling it again with other values edits the same file, as a user would."""
    def make(steps: int = 3, lr: float = 6e-3, flavor: str = "tiny", gpus_per_node: int = 8):
        path = tmp_path / "plan.toml"
        path.write_text(SMALL_PLAN.format(output=tmp_path / "out", steps=steps, lr=lr, flavor=flavor,
                                          gpus_per_node=gpus_per_node))
        return load_plan(path)
    return make


@pytest.fixture
def fake(tmp_path, monkeypatch, software):
    """The fake launcher's command; its calls are read back with calls(tmp_path)."""
    script = tmp_path / "fake_launcher"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom tests.protocol.fake_trainer import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    script.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    for variable in ("FAKE_FAIL", "FAKE_NOISE", "FAKE_KILL", "FAKE_SHORT", "FAKE_ROUNDING", "FAKE_OFFSET", "FAKE_SYNCS",
                     "FAKE_STEP_TIME", "FAKE_SLEEP"):
        monkeypatch.delenv(variable, raising=False)
    return [str(script)]


def calls(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
