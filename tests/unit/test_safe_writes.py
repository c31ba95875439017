"""The trainer's own files are never written through a link, and every folder a run writes is
locked: a `.lock`, `run_meta.json`, `metrics.jsonl`, `fingerprints.jsonl`, `checkpoint.json` or
`lineage.json` that is a symbolic link is refused by name and its target left as it was."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, TINY_JOB
from trainer.launch import run_lock
from trainer.records import run_meta
from trainer.checkpoint.lineage import write_head
from trainer.config.manager import load_config
from trainer.records.safe_writes import LinkRefused, append_text, open_append, write_atomic

PRECIOUS = "a user's file\n"


@pytest.fixture
def target(tmp_path) -> Path:
    """A file outside the folder that a planted link points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


def plant(folder: Path, name: str, target: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / name
    link.symlink_to(target)
    return link


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, target):
    link = plant(tmp_path / "run", ".lock", target)
    with pytest.raises(run_lock.LockRefused, match=f"job.dump_folder {tmp_path / 'run'}: {link} is a symbolic link"):
        run_lock.take(tmp_path / "run")
    assert target.read_text() == PRECIOUS and link.is_symlink()
    # A link to a file that does not exist yet is not created through either.
    missing = tmp_path / "elsewhere" / "created.txt"
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / ".lock").symlink_to(missing)
    with pytest.raises(run_lock.LockRefused, match="symbolic link"):
        run_lock.take(tmp_path / "run2")
    assert not missing.exists()


@pytest.mark.parametrize("name, write", [
    ("run_meta.json", lambda folder: run_meta.write_record(folder, {"status": "running"})),
    ("metrics.jsonl", lambda folder: open_append(folder / "metrics.jsonl").write('{"step": 1}\n')),
    ("fingerprints.jsonl", lambda folder: append_text(folder / "fingerprints.jsonl", '{"step": 1}\n')),
    ("lineage.json", lambda folder: write_head(folder, "abc", 3, [])),
    ("checkpoint.json", lambda folder: write_atomic(folder / "checkpoint.json", "{}")),
])
def test_a_record_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, target, name, write):
    folder = tmp_path / "run"
    plant(folder, name, target)
    with pytest.raises(LinkRefused, match=f"{folder / name} is a symbolic link: the trainer never writes"):
        write(folder)
    assert target.read_text() == PRECIOUS


def test_a_stale_temporary_file_that_is_a_link_is_removed_not_followed(tmp_path, target):
    folder = tmp_path / "run"
    plant(folder, ".run_meta.json.tmp", target)  # where write_atomic writes before renaming
    run_meta.write_record(folder, {"status": "running"})
    assert json.loads((folder / "run_meta.json").read_text()) == {"status": "running"}
    assert target.read_text() == PRECIOUS and not (folder / ".run_meta.json.tmp").exists()


def test_a_folder_where_a_record_should_be_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(LinkRefused, match="metrics.jsonl is a folder"):
        open_append(tmp_path / "metrics.jsonl")
    with pytest.raises(LinkRefused, match="metrics.jsonl is not a regular file"):
        run_meta.refuse_links(tmp_path)


def config(tmp_path: Path, *options: str):
    return load_config([*TINY_JOB, "--job.dump_folder", str(tmp_path / "run"), *options])


@pytest.mark.parametrize("options, locked", [
    ([], ["job.dump_folder"]),  # no checkpoints written
    (["--checkpoint.enable"], ["job.dump_folder", "checkpoint.folder"]),
    (["--checkpoint.enable", "--checkpoint.load_only"], ["job.dump_folder"]),  # reads checkpoints only
    (["--checkpoint.create_seed_checkpoint"], ["job.dump_folder", "checkpoint.folder"]),
    (["--checkpoint.enable", "--checkpoint.folder", "/shared/checkpoints"], ["job.dump_folder", "checkpoint.folder"]),
])
def test_the_folders_a_run_locks(tmp_path, options, locked):
    folders = run_lock.folders_of(config(tmp_path, *options))
    assert [key for _, key in folders] == locked
    if "/shared/checkpoints" in options:
        assert folders[1][0] == Path("/shared/checkpoints")
    elif len(locked) == 2:
        assert folders[1][0] == (tmp_path / "run" / "checkpoint").resolve()


def test_all_locks_or_none(tmp_path):
    held = run_lock.take(tmp_path / "checkpoints", "checkpoint.folder")
    try:
        folders = [(tmp_path / "run", "job.dump_folder"), (tmp_path / "checkpoints", "checkpoint.folder")]
        with pytest.raises(run_lock.LockRefused, match=f"checkpoint.folder {tmp_path / 'checkpoints'}: another job "
                                                       f"\\(PID {os.getpid()} on {socket.gethostname()}"):
            run_lock.take_all(folders)
        assert not (tmp_path / "run" / ".lock").exists()  # the dump folder's lock, taken first, was given back
        assert run_lock.held_by(tmp_path / "checkpoints", os.getpid())
        assert run_lock.take_unless_held(folders[1:], str(os.getpid())) == []  # the launcher (here: us) holds it
    finally:
        held.release()
    held.release()  # a second release does nothing
    assert not run_lock.held_by(tmp_path / "checkpoints", os.getpid())


def test_a_lock_replaced_by_hand_is_not_removed_by_its_old_holder(tmp_path):
    lock = run_lock.take(tmp_path)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").write_text("{}")  # someone's new file at the same name
    lock.release()
    assert (tmp_path / ".lock").read_text() == "{}"


def test_the_preflight_refuses_a_record_that_is_a_link_before_anything_starts(tmp_path, target):
    """Through the launcher: exit 2 in a second, one message naming the link, nothing written."""
    plant(tmp_path / "run", "metrics.jsonl", target)
    env = dict(os.environ, NGPU="1", PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([str(REPO / "torchrun_launch.sh"), *TINY_JOB, "--job.dump_folder", str(tmp_path / "run")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"error: {tmp_path / 'run' / 'metrics.jsonl'} is a symbolic link" in result.stderr
    assert "logs:" not in result.stdout and target.read_text() == PRECIOUS
