"""The preflight's decisions about the checkpoint a run resumes from, taken from the checkpoint
folder alone as trainer.checkpoint.manager.CheckpointManager.resume takes them, so that a run that is
complete or cannot continue ends in a second, before any rank starts. Torch-free."""

from __future__ import annotations

from pathlib import Path

from trainer.records import run_meta
from trainer.checkpoint.on_disk import (checkpoint_folder, complete_checkpoints, complete_message, finished_partials,
                                      is_full_checkpoint, missing_exports, past_steps_message,
                                      read_checkpoint_record)
from trainer.checkpoint.lineage import read_head
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError
from trainer.records.untrusted_json import RecordError



class RunComplete(SystemExit):
    """The checkpoint folder holds this run's final checkpoint: there is nothing to train.

    The ranks end such a run successfully (trainer.checkpoint.manager.TrainingComplete: exit 0 after
    saying so). Found before they start, it is a SystemExit with code 0, so that whatever runs the
    checks (the launcher, python -m trainer.preflight) ends the same way without starting them,
    whatever ConfigError handling it has; the catcher prints `message`."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message


def resume_candidate(config: JobConfig) -> tuple[int, Path] | None:
    """(step, path) of the checkpoint the ranks will resume from, when the folder alone decides
    it as trainer.checkpoint.manager.CheckpointManager.resume does: the newest complete one. None when
    they load none (checkpoint.enable off, an empty folder), load checkpoint.load_step, or may
    first publish a finished save as newer (a run that writes checkpoints does; whether that save
    is whole takes reading its .metadata, with torch)."""
    c = config.checkpoint
    if not c.enable or c.load_step != -1:
        return None
    folder = checkpoint_folder(config)
    found = complete_checkpoints(folder)
    if not found:
        return None
    newest = max(found)
    if not c.load_only and any(step >= newest for step in finished_partials(folder)):
        return None
    return newest, found[newest]


def check_resume(config: JobConfig) -> None:
    """The ranks' refusals of the newest checkpoint against training.steps, decided here first
    with their messages: one past training.steps is a ConfigError; this run's final checkpoint
    raises RunComplete with the ranks' note (whoever catches it prints it; this writes nothing)."""
    try:
        candidate = resume_candidate(config)
        if candidate is not None:  # what the ranks read to continue the run: damaged is refused now
            read_checkpoint_record(candidate[1])
            read_head(candidate[1].parent)
            run_meta.load_record(Path(config.job.dump_folder))
    except RecordError as e:
        raise ConfigError(str(e)) from None
    total = config.training.steps
    if candidate is None or candidate[0] == 0 or candidate[0] < total:
        return  # the seed, or a step to continue from
    newest, path = candidate
    if newest > total:
        full = is_full_checkpoint(path)
        if full is None:
            return  # the ranks read its metadata
        if full:
            raise ConfigError(past_steps_message(path, newest, total))
    if newest == total and not config.checkpoint.load_only and missing_exports(path, config):
        return  # the ranks write the exports the run stopped before writing
    raise RunComplete(complete_message(path, total))


def complete_record(config: JobConfig) -> str:
    """For a run found complete: its record completed when it stopped after its final save
    (run_meta.json still says "running"); what to add to the message. The caller holds the run's
    locks (trainer/launch/run_lock.py): nothing else writes the record meanwhile."""
    if run_meta.complete_after_final_save(Path(config.job.dump_folder), config.training.steps):
        return " (run_meta.json said the run was still running: it stopped after that save; now completed)"
    return ""
