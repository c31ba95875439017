"""trainer.version: the identity of the code a run ran."""

from __future__ import annotations

import subprocess

from trainer.version import changes_code, code_version, describe, git_state, source_hash


def git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_dirty_means_changed_code_not_a_users_files(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "a.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text("data")
    assert git_state(tmp_path)["dirty"] is False  # a user's data beside the checkout
    before = source_hash(tmp_path)
    (tmp_path / "trainer" / "b.py").write_text("y = 2\n")
    assert git_state(tmp_path)["dirty"] is True and source_hash(tmp_path) != before  # new trainer source
    (tmp_path / "trainer" / "b.py").unlink()
    (tmp_path / "trainer" / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path)["dirty"] is True and source_hash(tmp_path) != before
    assert changes_code(" M README.md") and not changes_code("?? slurm/") and changes_code("?? trainer/new/")


def test_outside_git_the_source_hash_still_identifies_the_code(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None}
    version = code_version()
    assert len(version["source_sha256"]) == 64
    assert describe({"commit": None, "source_sha256": "ab" * 32}) == "source abababababab (not a git checkout)"
    assert describe({"commit": "0123456789abcdef", "dirty": True}) == "01234567 (with local changes)"
