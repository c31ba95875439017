"""The checkpoint manager's decisions that need no process group: where a run continues from,
what retention keeps, how a changed schedule is continued."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.manager import CheckpointError, CheckpointManager, TrainingComplete
from trainer.checkpoint.items import TrainState
from trainer.checkpoint.on_disk import incomplete_step_folders
from trainer.config.job_config import JobConfig
from trainer.config.manager import to_dict
from trainer.optim import build_lr_scheduler, build_optimizer, schedule_change, set_schedule_position


def make_checkpoint(folder, step: int, items: list[str]) -> None:
    """A folder that looks complete (.metadata) and says what it holds (checkpoint.json)."""
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / "checkpoint.json").write_text(json.dumps({"step": step, "items": items}))


FULL = ["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]


def manager(tmp_path, steps: int = 10, keep: int = 10) -> CheckpointManager:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.enable = True
    config.checkpoint.keep_latest_k = keep
    config.training.steps = steps
    return CheckpointManager(config, model=None, optimizer=None, scheduler=None, loader=None,
                             train_state=TrainState(), rank=0)


def test_resume_point(tmp_path):
    folder = tmp_path / "checkpoint"
    make_checkpoint(folder, 0, ["model"])
    found = lambda: {int(p.name[5:]): p for p in sorted(folder.iterdir(), key=lambda p: int(p.name[5:]))}  # noqa: E731
    assert manager(tmp_path)._resume_point(found()) == folder / "step-0"  # the seed starts the run
    make_checkpoint(folder, 4, FULL)
    assert manager(tmp_path)._resume_point(found()) == folder / "step-4"
    with pytest.raises(TrainingComplete, match="nothing to do. Raise training.steps"):
        manager(tmp_path, steps=4)._resume_point(found())
    with pytest.raises(CheckpointError, match="past training.steps = 3"):
        manager(tmp_path, steps=3)._resume_point(found())
    make_checkpoint(folder, 6, ["model"])  # the model-only last save of earlier versions
    with pytest.raises(CheckpointError) as refused:
        manager(tmp_path, steps=8)._resume_point(found())
    message = str(refused.value)
    assert "holds the model weights only" in message
    assert "--checkpoint.load_step 4 --checkpoint.overwrite (steps 5-6 are trained again)" in message
    assert f"--checkpoint.initial_load_path {folder / 'step-6'}" in message
    with pytest.raises(TrainingComplete):
        manager(tmp_path, steps=6)._resume_point(found())


def test_retention_keeps_the_newest_full_checkpoint_and_the_seed(tmp_path):
    folder = tmp_path / "checkpoint"
    make_checkpoint(folder, 0, ["model"])
    for step in (2, 4):
        make_checkpoint(folder, step, FULL)
    make_checkpoint(folder, 6, ["model"])
    manager(tmp_path, keep=1)._apply_retention()
    assert sorted(p.name for p in folder.iterdir()) == ["step-0", "step-4", "step-6"]


def test_a_removed_checkpoint_is_never_seen_as_a_step_folder_in_part(tmp_path, monkeypatch):
    """Retention moves a step folder out of sight before emptying it: a reader of the folder
    meanwhile (another job's checks, a resume) never finds a step-N without .metadata. One that an
    interrupted removal left behind is removed when the next run opens the folder."""
    folder = tmp_path / "checkpoint"
    for step in (2, 4):
        make_checkpoint(folder, step, FULL)
    seen_while_emptying = []
    rmtree = shutil.rmtree

    def watched_rmtree(path, *args, **kwargs):
        seen_while_emptying.append(sorted(p.name for p in folder.iterdir()))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", watched_rmtree)
    manager(tmp_path, keep=1)._apply_retention()
    assert incomplete_step_folders(folder) == []
    assert seen_while_emptying[-1] == [".step-2.removing", "step-4"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]
    (folder / ".step-2.removing").mkdir()  # interrupted
    manager(tmp_path)._remove_stale_partials()
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]


def test_a_checkpoint_removed_between_the_listing_and_the_look_inside_is_not_a_folder_in_part(tmp_path,
                                                                                          monkeypatch):
    """Another job's checks list the folder while the live job's retention removes a step: the
    step-N listed is gone when its .metadata is looked for. It is not taken for a checkpoint copied
    in part (which named the wrong cause instead of the job holding the folder); a step-N that is
    there without .metadata still is."""
    folder = tmp_path / "checkpoint"
    for step in (2, 4):
        make_checkpoint(folder, step, FULL)
    listed, retained = Path.iterdir, []

    def listing_then_retention(path):
        names = list(listed(path))
        if path == folder and not retained:
            retained.append(True)
            manager(tmp_path, keep=1)._apply_retention()  # step-2 goes after the listing
        return iter(names)

    monkeypatch.setattr(Path, "iterdir", listing_then_retention)
    assert incomplete_step_folders(folder) == []
    monkeypatch.undo()
    (folder / "step-6").mkdir()  # copied in part
    assert incomplete_step_folders(folder) == [folder / "step-6"]


def test_a_link_at_a_removals_name_is_unlinked_and_what_it_points_to_kept(tmp_path):
    """A `.step-N.removing` that is a link (put there by hand) neither stops retention nor has what
    it points to removed."""
    folder, elsewhere = tmp_path / "checkpoint", tmp_path / "kept"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("x")
    for step in (2, 4, 6):
        make_checkpoint(folder, step, FULL)
    (folder / ".step-2.removing").symlink_to(elsewhere)
    (folder / ".step-4.removing").symlink_to(elsewhere)
    manager(tmp_path, keep=2)._apply_retention()
    assert sorted(p.name for p in folder.iterdir()) == [".step-4.removing", "step-4", "step-6"]
    manager(tmp_path)._remove_stale_partials()
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    assert (elsewhere / "data").read_text() == "x"


def test_retention_removes_a_linked_step_folder_and_keeps_what_it_links_to(tmp_path):
    """A step-N that is a link to a checkpoint kept elsewhere (linked in to resume it): retention
    removes the link, never the checkpoint it points to, and the run goes on."""
    folder, elsewhere = tmp_path / "checkpoint", tmp_path / "shared"
    make_checkpoint(elsewhere, 2, FULL)
    folder.mkdir()
    (folder / "step-2").symlink_to(elsewhere / "step-2")
    for step in (4, 6):
        make_checkpoint(folder, step, FULL)
    manager(tmp_path, keep=1)._apply_retention()
    assert sorted(p.name for p in folder.iterdir()) == ["step-6"]
    assert sorted(p.name for p in (elsewhere / "step-2").iterdir()) == [".metadata", "checkpoint.json"]


def test_incomplete_step_folder_stops_the_run(tmp_path):
    (tmp_path / "checkpoint" / "step-3").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="step-3 has no .metadata"):
        manager(tmp_path).resume()


def schedule_config(steps: int, warmup: int, decay_ratio=None) -> JobConfig:
    config = JobConfig()
    config.training.steps = steps
    config.lr_scheduler.warmup_steps = warmup
    config.lr_scheduler.decay_ratio = decay_ratio
    return config


def test_schedule_change_names_steps_whose_learning_rate_differs():
    assert schedule_change(to_dict(schedule_config(4, 10)), schedule_config(6, 10), 4) is None  # all in warmup
    assert schedule_change(to_dict(schedule_config(10, 2, 0.5)), schedule_config(20, 2, 0.5), 5) is None  # stable
    message = schedule_change(to_dict(schedule_config(10, 2)), schedule_config(15, 2), 10)
    assert message.startswith("steps 3-10 were trained with the learning-rate schedule of training.steps = 10")


def test_continued_schedule_takes_the_new_step_count():
    """The optimizer state saved at step 10 of a 10-step run holds the lr of that run's step 11."""
    old = schedule_config(10, 2)
    params = [("w", torch.nn.Parameter(torch.zeros(1)))]
    optimizer = build_optimizer(params, old.optimizer)
    scheduler = build_lr_scheduler(optimizer, old.lr_scheduler, 10)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    new = schedule_config(15, 2)
    resumed = build_lr_scheduler(optimizer, new.lr_scheduler, 15)
    resumed.load_state_dict(saved)
    set_schedule_position(resumed, resumed.last_epoch)
    reference = build_lr_scheduler(build_optimizer([("w", torch.nn.Parameter(torch.zeros(1)))], new.optimizer),
                                   new.lr_scheduler, 15)
    for _ in range(10):
        reference.optimizer.step()
        reference.step()
    assert optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0] == resumed.get_last_lr()[0]
    assert optimizer.param_groups[0]["lr"] > 0  # the 10-step schedule had reached 0 here


def test_a_finished_partial_save_counts_as_a_checkpoint_to_load(tmp_path):
    """DCP writes .metadata last: a .step-N.partial holding it is published at start, so the
    launcher's check accepts load_step N (not with load_only, which never publishes)."""
    from trainer.checkpoint.on_disk import check_load_options, finished_partials

    config = JobConfig()
    config.job.dump_folder, config.checkpoint.enable, config.checkpoint.load_step = str(tmp_path), True, 3
    partial = tmp_path / "checkpoint" / ".step-3.partial"
    partial.mkdir(parents=True)
    with pytest.raises(ValueError, match="the save of step 3 .* never completed"):
        check_load_options(config)
    (partial / ".metadata").write_bytes(b"x")
    assert finished_partials(tmp_path / "checkpoint") == {3: partial}
    check_load_options(config)
    config.checkpoint.load_only = True
    with pytest.raises(ValueError, match="finished but was never published; a run without checkpoint.load_only"):
        check_load_options(config)


def test_initial_load_folder_reads_the_hugging_face_export_of_a_step_folder(tmp_path):
    """With initial_load_in_hf, checkpoint.initial_load_path names a Hugging Face folder or a
    step-N saved with last_save_in_hf (its hf/); a folder with neither is refused, saying what
    would be valid, and a DCP checkpoint without the option is read as before."""
    from trainer.checkpoint.on_disk import initial_load_folder

    step = tmp_path / "checkpoint" / "step-6"
    make_checkpoint(tmp_path / "checkpoint", 6, FULL)
    assert initial_load_folder(step, in_hf=False) == step
    with pytest.raises(ValueError) as refused:
        initial_load_folder(step, in_hf=True)
    message = str(refused.value)
    assert message.startswith(f"checkpoint.initial_load_path: {step} has no config.json, nor hf/config.json")
    assert "a Hugging Face model folder (config.json + *.safetensors)" in message
    assert "a step-N checkpoint folder saved with checkpoint.last_save_in_hf" in message
    assert "is a DCP checkpoint, which loads without --checkpoint.initial_load_in_hf" in message

    (step / "hf").mkdir()
    (step / "hf" / "config.json").write_text("{}")
    assert initial_load_folder(step, in_hf=True) == step / "hf"
    assert initial_load_folder(step / "hf", in_hf=True) == step / "hf"
    assert initial_load_folder(step, in_hf=False) == step  # the DCP checkpoint, not the export
    with pytest.raises(ValueError, match="initial_load_model_only = false: .* hold the model only"):
        initial_load_folder(step, in_hf=True, model_only=False)
    with pytest.raises(ValueError) as refused:
        initial_load_folder(step / "hf", in_hf=False)
    assert str(refused.value) == (
        f"checkpoint.initial_load_path: {step / 'hf'} is not a complete DCP checkpoint (no .metadata file); expected "
        f"a DCP checkpoint folder (a step-N, or a seed checkpoint); {step / 'hf'} holds Hugging Face weights, which "
        "load with --checkpoint.initial_load_in_hf")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config.json, nor hf/config.json; .*\(the export is in its hf/\)$"):
        initial_load_folder(empty, in_hf=True)
    with pytest.raises(ValueError, match=r"no .metadata file\); expected a DCP checkpoint folder \(a step-N, or a "
                                         r"seed checkpoint\)$"):
        initial_load_folder(empty, in_hf=False)
    with pytest.raises(ValueError, match="does not exist"):
        initial_load_folder(tmp_path / "nope", in_hf=True)


def test_a_step_folder_with_its_hf_export_passes_the_launch_checks(tmp_path):
    from trainer.checkpoint.on_disk import check_load_options

    make_checkpoint(tmp_path / "saved" / "checkpoint", 4, FULL)
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "new")
    config.checkpoint.initial_load_path = str(tmp_path / "saved" / "checkpoint" / "step-4")
    config.checkpoint.initial_load_in_hf = True
    with pytest.raises(ValueError, match="step-4 has no config.json, nor hf/config.json"):
        check_load_options(config)
    (tmp_path / "saved" / "checkpoint" / "step-4" / "hf").mkdir()
    (tmp_path / "saved" / "checkpoint" / "step-4" / "hf" / "config.json").write_text("{}")
    check_load_options(config)


def test_host_memory_counts_the_hf_export_of_a_step_folder(tmp_path):
    """Every rank reads the safetensors files in full: those of step-N/hf/ when step-N is named."""
    from trainer.config.manager import load_config
    from trainer.preflight.checks import plan_run, training_memory_need

    step = tmp_path / "saved" / "checkpoint" / "step-4"
    (step / "hf").mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")
    (step / "hf" / "config.json").write_text("{}")
    with open(step / "hf" / "model.safetensors", "wb") as f:
        f.truncate(3_000_000_000)  # sparse: 3 GB on paper
    config = load_config(["--job.config_file", "llama3_8b.toml", "--checkpoint.initial_load_path", str(step),
                          "--checkpoint.initial_load_in_hf", "--job.dump_folder", str(tmp_path / "run")])
    need = training_memory_need(config, plan_run(config, 8).dims, "cuda", 8)
    assert need.bytes == 8 * 3_000_000_000 and str(step / "hf") in need.what
