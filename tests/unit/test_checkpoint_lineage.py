"""Lineage records and model variants (trainer/checkpoint/lineage.py), without a run."""

from __future__ import annotations

import json

import pytest

from trainer.checkpoint.lineage import (
    foreign_checkpoint,
    forked_ancestors,
    model_change,
    move_newer_aside,
    read_head,
    write_head,
)
from trainer.hf.__main__ import main as hf_main
from tests.unit.test_parallel_layout import problems

EXACT = {"tensor_parallel_sync": "full", "tensor_parallel_degree": 2}
GROUPED = {"tensor_parallel_sync": "grouped", "tensor_parallel_sync_group": 2, "tensor_parallel_degree": 2}


def checkpoint(folder, step: int, parallelism: dict, lineage: str = "aaa", kind: str = "periodic"):
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "checkpoint.json").write_text(json.dumps({"step": step, "kind": kind, "lineage": lineage,
                                                      "config": {"parallelism": parallelism}}))
    return path


@pytest.mark.parametrize("saved, now, changed", [
    (EXACT, {**EXACT, "tensor_parallel_degree": 4}, False),  # exact TP computes the same model at any degree
    (GROUPED, GROUPED, False),
    (GROUPED, EXACT, True),
    (EXACT, GROUPED, True),
    (GROUPED, {**GROUPED, "tensor_parallel_sync_group": 4}, True),
    (GROUPED, {**GROUPED, "tensor_parallel_degree": 4}, True),
    ({"tensor_parallel_sync": "per_block", "tensor_parallel_degree": 2}, GROUPED, True),
])
def test_model_change_between_variants(tmp_path, saved, now, changed):
    path = checkpoint(tmp_path, 4, saved)
    assert (model_change(path, now) is not None) == changed


def test_a_seed_fits_every_variant_and_the_message_names_both(tmp_path):
    assert model_change(checkpoint(tmp_path, 0, EXACT, kind="seed"), GROUPED) is None
    message = model_change(checkpoint(tmp_path, 8, GROUPED), {"tensor_parallel_sync": "per_block",
                                                              "tensor_parallel_degree": 2})
    assert 'trained as tensor_parallel_sync = "grouped", 2 blocks per sync at tensor_parallel_degree 2' in message
    assert 'this run builds tensor_parallel_sync = "per_block" at tensor_parallel_degree 2' in message


def test_a_checkpoint_of_another_lineage_is_named(tmp_path):
    ours = checkpoint(tmp_path, 4, EXACT, lineage="ours")
    theirs = checkpoint(tmp_path, 6, EXACT, lineage="theirs")
    assert foreign_checkpoint(tmp_path, theirs) is None  # no lineage.json: an earlier version's folder
    write_head(tmp_path, "ours", 4, [])
    assert read_head(tmp_path) == {"lineage": "ours", "step": 4, "ancestors": []}
    assert foreign_checkpoint(tmp_path, ours) is None
    message = foreign_checkpoint(tmp_path, theirs)
    assert message.startswith(f"{theirs} belongs to another training trajectory (lineage theirs)")
    assert f"--checkpoint.initial_load_path {theirs}" in message


def test_checkpoints_up_to_a_fork_stay_on_the_trajectory(tmp_path):
    """Rewound from lineage A at step 4 to lineage B: A's step-2 and step-4 are B's history (a
    restart before B's first save resumes step-4), A's step-6 is not."""
    a2, a4, a6 = (checkpoint(tmp_path, s, EXACT, lineage="A") for s in (2, 4, 6))
    head = {"lineage": "A", "step": 6, "ancestors": []}
    ancestors = forked_ancestors(head, a4, 4)
    assert ancestors == [{"lineage": "A", "until_step": 4}]
    write_head(tmp_path, "B", 4, ancestors)
    assert foreign_checkpoint(tmp_path, a2) is None and foreign_checkpoint(tmp_path, a4) is None
    assert foreign_checkpoint(tmp_path, a6) is not None
    # A second rewind, from B to A's step 2: only A up to step 2 and B up to step 2 remain history.
    again = forked_ancestors(read_head(tmp_path), a2, 2)
    assert again == [{"lineage": "A", "until_step": 2}, {"lineage": "B", "until_step": 2}]
    write_head(tmp_path, "C", 2, again)
    assert foreign_checkpoint(tmp_path, a2) is None and foreign_checkpoint(tmp_path, a4) is not None


def test_moving_newer_checkpoints_aside_keeps_them(tmp_path):
    found = {s: checkpoint(tmp_path, s, EXACT) for s in (2, 4, 6, 8)}
    target = move_newer_aside(tmp_path, found, 4)
    assert target.parent == tmp_path / "previous" and target.name.endswith("-after-step-4")
    assert sorted(p.name for p in target.iterdir()) == ["step-6", "step-8"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-4"]
    assert move_newer_aside(tmp_path, {2: found[2]}, 4) is None


def test_hugging_face_export_of_a_reduced_variant_is_refused(tmp_path, capsys):
    path = checkpoint(tmp_path, 8, GROUPED)
    code = hf_main(["export", "--dcp", str(path), "--flavor", "tiny", "--out", str(tmp_path / "hf")])
    assert code != 0 and "--accept-model-change" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert any("checkpoint.last_save_in_hf" in p for p in problems(
        2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_sync", "per_block",
        "--checkpoint.enable", "--checkpoint.last_save_in_hf"))
    assert not any("checkpoint.last_save_in_hf" in p for p in problems(
        2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_sync", "per_block",
        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.accept_model_change"))
