"""A finished run is reused only when its own record equals what the plan would run now; a stale
run is refused with one message naming every difference, or with --rerun-stale moved aside (never
deleted) and run again. Runs go through the fake launcher (tests/protocol/fake_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from protocol.plan.model import RUN_MARKER, SUPERSEDED_DIR
from protocol.plan.select import LaunchError
from protocol.run.folders import CLAIM_FUNCTION, claim_command, foreign_folder
from protocol.run.local import run_local
from protocol.run.reuse import RUN, STALE, assess
from protocol.run.sbatch import write_slurm
from tests.protocol.conftest import calls
from tests.protocol.fake_trainer import FAKE_CODE


def run_all(plan, fake, **kwargs):
    return [r.status for r in run_local(plan, plan.launches(), launcher=fake, **kwargs)]


def refusal(plan, fake) -> str:
    with pytest.raises(LaunchError) as info:
        run_local(plan, plan.launches(), launcher=fake)
    return str(info.value)


def record(folder) -> dict:
    return json.loads((folder / "run_meta.json").read_text())


def test_a_changed_set_override_is_refused_by_name_then_rerun_with_the_flag(small_plan, fake, tmp_path):
    plan = small_plan(lr=6e-3)
    assert run_all(plan, fake) == ["completed"] * 4
    plan = small_plan(lr=3e-3)  # the user edits the set's option
    message = refusal(plan, fake)
    assert message == (
        f"1 run in {plan.output} was made with something other than what {plan.path} runs now, so its results "
        "would not describe the plan:\n  lr x2: optimizer.lr 0.006 -> 0.003\n"
        "Run it again by adding --rerun-stale to the same `protocol run` command (its folder moves to "
        f"{plan.output / SUPERSEDED_DIR}/, nothing is deleted), or restore what it was made with.")
    assert len(calls(tmp_path)) == 4  # refused before anything ran

    messages: list[str] = []
    results = run_local(plan, plan.launches(), launcher=fake, rerun_stale=True, on_progress=messages.append)
    assert [r.status for r in results] == ["already complete", "already complete", "already complete", "completed"]
    assert [c["run"] for c in calls(tmp_path)][4:] == ["lr-x2"]
    assert record(plan.output / "lr-x2")["config"]["optimizer"]["lr"] == 0.003
    (moved,) = (plan.output / SUPERSEDED_DIR).iterdir()
    assert moved.name.startswith("lr-x2-") and record(moved)["config"]["optimizer"]["lr"] == 0.006
    assert (moved / RUN_MARKER).is_file() and (moved / "metrics.jsonl").is_file()
    assert any(m.startswith(f"lr x2: stale (optimizer.lr 0.006 -> 0.003); moved to {moved}") for m in messages)
    assert run_all(plan, fake) == ["already complete"] * 4


def test_more_steps_make_every_training_run_stale_but_not_the_seed(small_plan, fake):
    run_all(small_plan(steps=3), fake)
    plan = small_plan(steps=5)
    message = refusal(plan, fake)
    assert "\n  every training run: training.steps 3 -> 5\n" in message and "3 runs in" in message
    assert run_all(plan, fake, rerun_stale=True) == ["already complete", "completed", "completed", "completed"]
    assert record(plan.output / "control")["last_step"] == 5
    assert len(list((plan.output / SUPERSEDED_DIR).iterdir())) == 3


def test_another_model_makes_the_seed_stale_and_every_run_that_loads_it(small_plan, fake, tmp_path):
    run_all(small_plan(flavor="tiny"), fake)
    plan = small_plan(flavor="debugmodel")
    message = refusal(plan, fake)
    assert "\n  every run: model.flavor tiny -> debugmodel\n" in message
    assert "\n  every training run: it started from the seed checkpoint, which is stale\n" in message
    assert run_all(plan, fake, rerun_stale=True) == ["completed"] * 4
    seed = json.loads((plan.seed_checkpoint_path / "checkpoint.json").read_text())
    assert seed["config"]["model"]["flavor"] == "debugmodel"
    assert sorted(p.name.rsplit("-", 2)[0] for p in (plan.output / SUPERSEDED_DIR).iterdir()) == [
        "control", "fsdp-tp2", "lr-x2", "seed"]


def test_changed_trainer_code_makes_every_run_stale(small_plan, fake, software):
    plan = small_plan()
    run_all(plan, fake)
    software(code={**FAKE_CODE, "commit": "8b0e44aa" + "1" * 32, "source_sha256": "b" * 64})
    message = refusal(plan, fake)
    assert "\n  every run: trainer code changed (3f2a1c9d -> 8b0e44aa)\n" in message
    # A local edit on the same commit: the source hashes tell the two apart.
    software(code={**FAKE_CODE, "dirty": True, "source_sha256": "c" * 64})
    (changed,) = [line for line in refusal(plan, fake).splitlines() if "trainer code" in line]
    assert changed == ("  every run: trainer code changed (3f2a1c9d, source aaaaaaaaaaaa -> 3f2a1c9d (with local "
                       "changes), source cccccccccccc)")


def test_another_torch_makes_the_runs_stale(small_plan, fake, software):
    plan = small_plan()
    run_all(plan, fake)
    software(torch="2.14.0+cu128")
    message = refusal(plan, fake)
    assert "\n  every run: torch 2.13.0+cpu -> 2.14.0+cu128\n" in message  # the seed checkpoint's too
    assert "\n  every training run: it started from the seed checkpoint, which is stale\n" in message


def test_runs_made_in_another_clone_of_the_repository_are_reused(small_plan, fake, tmp_path):
    plan = small_plan()
    run_all(plan, fake)
    # The same runs made from a checkout elsewhere: only the config file's path differs.
    elsewhere = "/elsewhere/llama_pretrain/train_configs/debug_model.toml"
    for path in [plan.seed_checkpoint_path / "checkpoint.json", *plan.output.glob("*/run_meta.json")]:
        saved = json.loads(path.read_text())
        assert saved["config"]["job"]["config_file"] != elsewhere
        saved["config"]["job"]["config_file"] = elsewhere
        path.write_text(json.dumps(saved))
    assert run_all(plan, fake) == ["already complete"] * 4
    assert len(calls(tmp_path)) == 4
    # What the file held is still compared, option by option.
    assert "lr x2: optimizer.lr 0.006 -> 0.003" in refusal(small_plan(lr=3e-3), fake)


def test_runs_made_from_an_earlier_seed_checkpoint_are_stale(small_plan, fake):
    plan = small_plan()
    run_all(plan, fake)
    metadata = plan.seed_checkpoint_path / ".metadata"
    before = json.loads((plan.output / "control" / "run_meta.json").read_text())["start"]["fingerprint"]
    metadata.write_text("another save")  # the seed was made again, by hand
    from trainer.checkpoint.on_disk import fingerprint

    message = refusal(plan, fake)
    assert (f"every training run: it started from seed checkpoint {before[:8]}, the seed checkpoint now is "
            f"{fingerprint(plan.seed_checkpoint_path)[:8]}") in message


def test_a_seed_checkpoint_without_its_record_cannot_be_reused(small_plan, fake):
    plan = small_plan()
    run_all(plan, fake, only=["seed"])
    (plan.seed_checkpoint_path / "checkpoint.json").unlink()
    decisions = assess(plan, plan.launches())
    assert decisions["seed"].action == STALE
    assert decisions["seed"].differences == ("its checkpoint has no checkpoint.json (written by an older trainer), "
                                             "so what made it cannot be checked",)
    assert decisions["control"].action == RUN  # nothing there yet


def test_an_incomplete_run_with_the_same_record_runs_again_in_its_folder(small_plan, fake, monkeypatch):
    plan = small_plan()
    monkeypatch.setenv("FAKE_SHORT", "control")
    assert run_all(plan, fake) == ["completed", "failed", "completed", "completed"]
    monkeypatch.delenv("FAKE_SHORT")
    decision = assess(plan, plan.launches())["control"]
    assert (decision.action, decision.reason) == (RUN, "the previous attempt's record says 'running' at step 2 of 3")
    assert run_all(plan, fake) == ["already complete", "completed", "already complete", "already complete"]
    assert not (plan.output / SUPERSEDED_DIR).exists()
    # The trainer kept the attempt's record and metrics beside the new ones.
    (previous,) = (plan.output / "control" / "previous").iterdir()
    assert record(previous)["status"] == "running"


def test_a_failed_run_made_with_other_options_is_stale_too(small_plan, fake, monkeypatch):
    monkeypatch.setenv("FAKE_SHORT", "lr-x2")
    run_all(small_plan(lr=6e-3), fake)
    monkeypatch.delenv("FAKE_SHORT")
    # Rerunning it in place could resume from its checkpoints under the new options.
    assert "lr x2: optimizer.lr 0.006 -> 0.003" in refusal(small_plan(lr=3e-3), fake)


def test_a_record_of_an_older_trainer_is_stale(small_plan, fake):
    plan = small_plan()
    run_all(plan, fake)
    folder = plan.output / "control"
    old = {k: v for k, v in record(folder).items() if k not in ("format", "status", "code", "start")}
    (folder / "run_meta.json").write_text(json.dumps(old))
    assert ("control: its run_meta.json was written by an older trainer, which did not record enough to check "
            "what it ran") in refusal(plan, fake)


def test_a_run_named_like_the_superseded_folder_is_refused(small_plan):
    from protocol.plan.load import PlanError, load_plan

    plan = small_plan()
    plan.path.write_text(plan.path.read_text().replace('name = "lr x2"', 'name = "Superseded"'))
    with pytest.raises(PlanError, match="name 'Superseded' gives the output folder 'superseded', which the protocol "
                                        "keeps for runs moved aside; choose another name"):
        load_plan(plan.path)


# ---------------------------------------------------------------------------------------------
# Runs started by the generated scripts


def run_bash(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)


def test_the_scripts_claim_writes_the_marker_protocol_run_writes(small_plan):
    plan = small_plan()
    launch = plan.launches()[2]
    done = run_bash(f"set -euo pipefail\n{CLAIM_FUNCTION}\n{claim_command(plan, launch)}")
    assert done.returncode == 0, done.stderr
    marker = json.loads((launch.output / RUN_MARKER).read_text())
    assert marker == {"plan": "small", "run": "FSDP+TP2", "command": launch.command(), "created": marker["created"]}
    assert foreign_folder(plan, launch) is None


def test_the_scripts_claim_refuses_folders_of_others(small_plan, tmp_path):
    plan = small_plan()
    launch = plan.launches()[1]
    launch.output.mkdir(parents=True)
    (launch.output / "notes.txt").write_text("mine")
    script = f"set -euo pipefail\n{CLAIM_FUNCTION}\n{claim_command(plan, launch)}\necho started"
    done = run_bash(script)
    assert done.returncode == 2 and "started" not in done.stdout
    assert f"error: {launch.output} exists and was not made by the protocol" in done.stderr
    assert sorted(p.name for p in launch.output.iterdir()) == ["notes.txt"]
    (launch.output / "notes.txt").unlink()
    (launch.output / RUN_MARKER).write_text(json.dumps({"plan": "other", "run": "control"}))
    done = run_bash(script)
    assert done.returncode == 2 and "belongs to another plan or run" in done.stderr


def test_a_seed_made_by_its_sbatch_script_is_reused_by_protocol_run(small_plan, fake, tmp_path):
    """The sbatch script claims the folder, so `protocol run` recognizes the seed it made."""
    plan = small_plan()
    write_slurm(plan, plan.launches(), tmp_path / "slurm")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun --ntasks=1 PYTHON -m trainer.launch --nproc 1 --device cpu ARGS: the fake launcher gets ARGS
    (bin_dir / "srun").write_text(f'#!/usr/bin/env bash\nshift\nexec {fake[0]} "${{@:8}}"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "1", "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(tmp_path / "slurm" / "seed.sbatch")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads((plan.output / "seed" / RUN_MARKER).read_text())["run"] == "seed"
    again = subprocess.run(["bash", str(tmp_path / "slurm" / "seed.sbatch")], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "step-0 exists, kept" in again.stdout  # a resubmitted seed job succeeds
    results = run_local(plan, plan.launches(), launcher=fake)
    assert [r.status for r in results] == ["already complete", "completed", "completed", "completed"]


def resume(folder, changes: dict | None = None) -> None:
    """Append a resumed start to a run's record, as the trainer does (the first start goes to
    history); `changes` alters the earlier start's configuration."""
    from trainer.records.run_meta import begin, finish

    latest = {k: v for k, v in record(folder).items() if k in ("config", "code", "world_size", "degrees", "torch")}
    earlier = record(folder)
    for key, value in (changes or {}).items():
        section, name = key.split(".")
        earlier["config"][section][name] = value
    (folder / "run_meta.json").write_text(json.dumps(earlier))
    start = {"kind": "resume", "path": str(folder / "checkpoint" / "step-2"), "step": 2, "fingerprint": "f" * 16}
    finish(folder, begin(folder, {**latest, "start": start}, 2), "completed", earlier["last_step"])


def test_a_resumed_run_is_reused_when_every_start_ran_as_the_plan_says(small_plan, fake):
    plan = small_plan()
    run_all(plan, fake)
    resume(plan.output / "control")
    assert [len(record(plan.output / "control")["history"])] == [1]
    assert run_all(plan, fake) == ["already complete"] * 4
    resume(plan.output / "lr-x2", {"optimizer.lr": 0.009})  # its first start ran with another lr
    assert record(plan.output / "lr-x2")["config"]["optimizer"]["lr"] == 0.006
    assert "lr x2: optimizer.lr 0.009 -> 0.006" in refusal(plan, fake)
