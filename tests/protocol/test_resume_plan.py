"""An interrupted `protocol run` resumes each unfinished run from its own newest checkpoint, onto
the same curve: with real training runs (the tiny model, gloo on CPU), a plan interrupted in the
middle of a run and run again gives the report and the loss curves of the plan run straight
through, bitwise, and the seed checkpoint it started from is never written to. Through the fake
launcher: which runs resume and from which step, a run of other options is refused rather than
resumed, and the plan key's validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.plan.load import PlanError, load_plan
from protocol.plan.model import slugify
from protocol.plan.select import LaunchError
from protocol.run.local import run_local
from tests.protocol.conftest import calls
from tests.warm_python import REAL_PROCESSES

ROOT = Path(__file__).resolve().parents[2]
# The set is interrupted once it logged step 4 (after its step-3 save), well before step 12.
STEPS, INTERVAL, INTERRUPT_AT = 12, 3, 4
SET = "AC full"

# cpu_smoke's model and numerics, fewer steps, a save every 3 steps.
PLAN = f"""
[plan]
name = "resume"
config = "debug_model.toml"
output = "out"
steps = {STEPS}
warmup_steps = 2
local_batch_size = 4
dp_degree = 2
checkpoint_interval = {INTERVAL}

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"optimizer.lr" = 3e-3
"optimizer.weight_decay" = 0.0
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"debug.deterministic" = true

[tolerance]
mode = "exact"

[control]
name = "1D FSDP"

[[sets]]
name = "{SET}"
kind = "technique"
overrides = {{ "activation_checkpoint.mode" = "full" }}
"""


def start(folder: Path, *args: str, real_processes: bool = False) -> subprocess.Popen:
    """`protocol run plan.toml ARGS` in `folder`, in a process group of its own (as a terminal's
    foreground job: Ctrl-C reaches the protocol, the launcher and the ranks, which must then be
    real interpreters, not forks of the warm Python in sessions of their own: tests/warm_python)."""
    folder.mkdir(exist_ok=True)
    (folder / "plan.toml").write_text(PLAN)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT),
           **(REAL_PROCESSES if real_processes else {})}
    return subprocess.Popen([sys.executable, "-m", "protocol", "run", "plan.toml", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=default_interrupt)


def default_interrupt() -> None:
    """Ctrl-C as a terminal delivers it: a test suite started in the background (`cmd &` in a
    script) ignores SIGINT, and every process it starts would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    return output


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")] \
        if path.is_file() else []
    return max(steps, default=0)


def curve(run: Path) -> list[tuple]:
    """Every training step's logged numbers (not its timings), in file order."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records if "kind" not in r]


def results(out: Path) -> list[dict]:
    return json.loads((out / "report.json").read_text())["results"]


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_an_interrupted_plan_resumes_onto_the_same_curves(tmp_path):
    straight = tmp_path / "straight"
    finish(start(straight, "--compare"))

    resumed = tmp_path / "resumed"
    out, run = resumed / "out", resumed / "out" / slugify(SET)
    proc = start(resumed, real_processes=True)  # Ctrl-C reaches it through its process group
    while last_step(run) < INTERRUPT_AT and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    record = json.loads((run / "run_meta.json").read_text())
    assert record["status"] != "completed" and INTERRUPT_AT <= record["last_step"] < STEPS, record
    seed = tree_hash(out / "seed")

    output = finish(start(resumed, "--compare"))
    assert "[2/3] 1D FSDP: already complete, skipped" in output, output
    assert f"[3/3] {SET}: running 2 processes" in output and ", resuming from step " in output, output
    record = json.loads((run / "run_meta.json").read_text())
    assert record["status"] == "completed" and record["last_step"] == STEPS
    resumed_from = record["start"]
    assert resumed_from["kind"] == "resume" and resumed_from["step"] >= INTERVAL, resumed_from
    assert resumed_from["step"] % INTERVAL == 0 and f"resuming from step {resumed_from['step']} " in output
    assert [start["start"]["kind"] for start in record["history"]] == ["checkpoint"]  # its first start: the seed
    assert tree_hash(out / "seed") == seed
    # Nothing but the seed run's own step-0 in its checkpoint folder: no run saved next to it.
    for folder in (out, straight / "out"):
        assert [p.name for p in (folder / "seed" / "checkpoint").iterdir()] == ["step-0"]

    for name in ("1D FSDP", SET):
        assert curve(run.parent / slugify(name)) == curve(straight / "out" / slugify(name))
        assert [step for step, *_ in curve(run.parent / slugify(name))] == list(range(1, STEPS + 1))
    assert results(out) == results(straight / "out")
    assert results(out)[0]["outcome"] == "PASS"


# ---------------------------------------------------------------------------------------------
# Through the fake launcher (tests/protocol/fake_trainer.py): what the protocol decides and says


def test_an_unfinished_run_resumes_from_its_newest_checkpoint_and_says_so(small_plan, fake, tmp_path, monkeypatch):
    plan = small_plan(steps=5)
    monkeypatch.setenv("FAKE_SHORT", "lr-x2")  # stops after step 4, its record still "running"
    assert [r.status for r in run_local(plan, plan.launches(), launcher=fake)][-1] == "failed"
    checkpoints = plan.output / "lr-x2" / "checkpoint"
    for step in (2, 4):  # what its saves would have left
        (checkpoints / f"step-{step}").mkdir(parents=True)
        (checkpoints / f"step-{step}" / ".metadata").write_text("")
    (checkpoints / ".step-5.partial").mkdir()  # a save that never finished: not resumed from

    monkeypatch.delenv("FAKE_SHORT")
    messages: list[str] = []
    results = run_local(plan, plan.launches(), launcher=fake, on_progress=messages.append)
    assert [r.status for r in results] == ["already complete"] * 3 + ["completed"]
    assert [c["run"] for c in calls(tmp_path)][4:] == ["lr-x2"]
    assert f"[4/4] lr x2: running 2 processes, the previous attempt's record says 'running' at step 4 of 5, " \
           f"resuming from step 4 ({checkpoints}) ... (log: {plan.output / 'lr-x2' / 'protocol.log'})" in messages
    assert not any("resuming" in m for m in messages if not m.startswith("[4/4]"))


def test_an_unfinished_run_of_other_options_is_refused_not_resumed(small_plan, fake, tmp_path, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_SHORT", "lr-x2")
    run_local(plan, plan.launches(), launcher=fake)
    (plan.output / "lr-x2" / "checkpoint" / "step-2").mkdir(parents=True)
    (plan.output / "lr-x2" / "checkpoint" / "step-2" / ".metadata").write_text("")
    plan = small_plan(lr=3e-3)
    with pytest.raises(LaunchError, match="lr x2: optimizer.lr 0.006 -> 0.003"):
        run_local(plan, plan.launches(), launcher=fake)
    assert len(calls(tmp_path)) == 4


def test_the_save_interval_does_not_make_runs_stale(small_plan, fake, tmp_path):
    plan = small_plan()
    run_local(plan, plan.launches(), launcher=fake)
    text = plan.path.read_text().replace("[plan]\n", "[plan]\ncheckpoint_interval = 7\n")
    plan.path.write_text(text)
    plan = load_plan(plan.path)
    assert plan.checkpoint_interval == 7 and "--checkpoint.interval" in plan.launches()[1].args
    assert [r.status for r in run_local(plan, plan.launches(), launcher=fake)] == ["already complete"] * 4
    assert len(calls(tmp_path)) == 4


@pytest.mark.parametrize("line, problem", [
    ("checkpoint_interval = 0", "plan.checkpoint_interval: must be >= 1, got 0"),
    ("checkpoint_interval = \"100\"", "plan.checkpoint_interval: expected an integer, got '100'"),
    ("overrides = { \"checkpoint.interval\" = 5 }",
     "plan.overrides.\"checkpoint.interval\": set by the plan; use plan.checkpoint_interval"),
    ("overrides = { \"checkpoint.load_only\" = true }",
     "plan.overrides.\"checkpoint.load_only\": set by the plan; use plan.checkpoint_interval"),
])
def test_a_bad_checkpoint_interval_is_one_error_naming_the_key(small_plan, line, problem):
    plan = small_plan()
    text = plan.path.read_text().replace("overrides = {", "#", 1).replace("[plan]\n", f"[plan]\n{line}\n")
    plan.path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(plan.path)
    assert problem in str(info.value) and str(info.value).count("\n  - ") == 1, str(info.value)
