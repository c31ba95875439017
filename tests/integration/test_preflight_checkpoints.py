"""What the checkpoint folder alone decides is decided by the launcher's preflight, before any rank
starts (and without importing torch): an existing seed checkpoint, a run that is complete, a
checkpoint past training.steps. The messages and exit codes are the ranks' own."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.launch import TINY_JOB, describe, launch
from trainer.config.manager import ConfigError, load_config
from trainer.preflight.checks import RunComplete, check_resume, check_seed, resume_candidate

# A refused launch runs the preflight only: well under a second on an idle machine; the ranks
# would take 13-24 s to start (torch, the process group) before refusing.
REFUSED_WITHIN_S = 8


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The dump folder of a finished 2-step run with full checkpoints step-1 and step-2."""
    dump = tmp_path_factory.mktemp("finished") / "run"
    result = launch(1, job(dump, 2, "--checkpoint.interval", "1"))
    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-1", "step-2"]
    return dump


def job(dump: Path, steps: int, *options: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(steps), "--checkpoint.enable", "--job.dump_folder", str(dump), *options]


def copy_of(finished: Path, tmp_path: Path) -> Path:
    dump = tmp_path / "run"
    shutil.copytree(finished, dump)
    return dump


def timed_launch(args: list[str]):
    started = time.monotonic()
    result = launch(1, args)
    return result, time.monotonic() - started


def log_folders(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "logs").iterdir())


@pytest.mark.parametrize("options", [[], ["--checkpoint.load_only"]])
def test_a_complete_run_ends_successfully_before_any_rank_starts(finished, options):
    logs = log_folders(finished)
    result, seconds = timed_launch(job(finished, 2, *options))
    final = finished / "checkpoint" / "step-2"
    assert result.returncode == 0, describe(result)
    assert (f"{final} is the final checkpoint of this run (training.steps = 2); nothing to do. Raise training.steps "
            "to continue.") in result.stdout
    assert seconds < REFUSED_WITHIN_S, f"{seconds:.1f} s"
    assert log_folders(finished) == logs  # no rank was started (each start has a log folder)


def test_a_checkpoint_past_training_steps_is_refused_before_any_rank_starts(finished):
    logs = log_folders(finished)
    result, seconds = timed_launch(job(finished, 1))
    assert result.returncode == 2, describe(result)
    assert (f"error: {finished / 'checkpoint' / 'step-2'} is past training.steps = 1: this run went further "
            "already. Raise training.steps above 2 to continue it") in result.stderr
    assert seconds < REFUSED_WITHIN_S, f"{seconds:.1f} s"
    assert log_folders(finished) == logs


def test_a_model_only_checkpoint_past_training_steps_is_complete(finished, tmp_path):
    """The ranks refuse only a full checkpoint past training.steps; a weights-only one ends the run."""
    dump = copy_of(finished, tmp_path)
    record_file = dump / "checkpoint" / "step-2" / "checkpoint.json"
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({**record, "items": ["model"]}))
    result, seconds = timed_launch(job(dump, 1))
    assert result.returncode == 0 and "nothing to do" in result.stdout, describe(result)
    assert seconds < REFUSED_WITHIN_S, f"{seconds:.1f} s"


def test_an_existing_seed_checkpoint_is_refused_before_the_seed_process_starts(finished, tmp_path):
    dump = copy_of(finished, tmp_path)
    seed = dump / "checkpoint" / "step-0"
    shutil.copytree(dump / "checkpoint" / "step-1", seed)
    before = (seed / ".metadata").read_bytes()
    result, seconds = timed_launch([*TINY_JOB, "--job.dump_folder", str(dump), "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 2, describe(result)
    assert f"error: {seed} exists already; refusing to overwrite it (use --checkpoint.overwrite)" in result.stderr
    assert seconds < REFUSED_WITHIN_S, f"{seconds:.1f} s"
    assert (seed / ".metadata").read_bytes() == before


# The cases the preflight leaves to the ranks, and its decisions, without a launch.

def config_of(dump: Path, steps: int, *options: str):
    return load_config(job(dump, steps, *options))


@pytest.mark.parametrize("steps, options", [
    (3, []),  # step-2 is a step to continue from
    (1, ["--checkpoint.no_enable"]),  # no checkpoint is loaded
    (1, ["--checkpoint.load_step", "1"]),  # a named step (checked by check_load_options)
    (2, ["--checkpoint.load_step", "2"]),  # a named step, even the final one: the ranks train nothing more
])
def test_runs_that_may_start(finished, steps, options):
    check_resume(config_of(finished, steps, *options))


def test_a_record_without_items_is_left_to_the_ranks(finished, tmp_path):
    """Checkpoints of earlier versions list no items: only their DCP metadata says if they are full."""
    dump = copy_of(finished, tmp_path)
    (dump / "checkpoint" / "step-2" / "checkpoint.json").unlink()
    check_resume(config_of(dump, 1))
    with pytest.raises(RunComplete):  # whatever it holds, step-2 is this run's last when training.steps = 2
        check_resume(config_of(dump, 2))


def test_a_finished_save_the_ranks_publish_first_is_left_to_them(finished, tmp_path):
    """A run that writes checkpoints publishes a finished .step-N.partial at start (if whole, which
    takes torch to tell): the newest checkpoint is then theirs to decide. load_only publishes none."""
    dump = copy_of(finished, tmp_path)
    folder = dump / "checkpoint"
    shutil.copytree(folder / "step-2", folder / ".step-3.partial")
    assert resume_candidate(config_of(dump, 2)) is None
    check_resume(config_of(dump, 2))
    assert resume_candidate(config_of(dump, 2, "--checkpoint.load_only")) == (2, folder / "step-2")
    with pytest.raises(RunComplete) as complete:
        check_resume(config_of(dump, 2, "--checkpoint.load_only"))
    assert complete.value.code == 0 and "nothing to do" in complete.value.message


def test_a_seed_checkpoint_is_replaced_with_overwrite(finished, tmp_path):
    dump = copy_of(finished, tmp_path)
    shutil.copytree(dump / "checkpoint" / "step-1", dump / "checkpoint" / "step-0")
    with pytest.raises(ConfigError, match="step-0 exists already"):
        check_seed(load_config([*TINY_JOB, "--job.dump_folder", str(dump)]))
    check_seed(load_config([*TINY_JOB, "--job.dump_folder", str(dump), "--checkpoint.overwrite"]))
    # The seed alone is a start, not a finished run.
    shutil.rmtree(dump / "checkpoint" / "step-1")
    shutil.rmtree(dump / "checkpoint" / "step-2")
    check_resume(config_of(dump, 1))


def test_a_run_killed_after_its_final_save_is_recorded_as_completed(finished, tmp_path):
    """Killed between its final checkpoint and its record's last write: the record still says
    "running". The next start finds the run complete and completes its record too (the protocol
    reads it to tell a finished run)."""
    dump = copy_of(finished, tmp_path)
    record = json.loads((dump / "run_meta.json").read_text())
    (dump / "run_meta.json").write_text(json.dumps({**record, "status": "running", "ended": None, "last_step": 1}))
    result, _ = timed_launch(job(dump, 2))
    assert result.returncode == 0 and "now completed" in result.stdout, describe(result)
    completed = json.loads((dump / "run_meta.json").read_text())
    assert (completed["status"], completed["last_step"], completed["completed_at_restart"]) == ("completed", 2, True)
    again, _ = timed_launch(job(dump, 2))  # a completed record is left as it is
    assert again.returncode == 0 and "now completed" not in again.stdout, describe(again)
