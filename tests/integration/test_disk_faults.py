"""Real disks that fill up or cannot be written: a small tmpfs mounted for the test (root only;
CI runs as root and sets TRAINER_REQUIRE_TMPFS=1, so that there these tests cannot be skipped).
Each failure is one message naming the cause and the file, no automatic restart of what cannot
succeed, and a record that says what happened; with space again, the same command goes on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import TINY_JOB, describe, launch, read_metrics


@pytest.fixture
def disk(tmp_path):
    """A tmpfs of a given size (KiB) at tmp_path/disk; `disk.resize(kib)` and `disk.read_only()`
    remount it. Unmounted at the end."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()

    class Disk:
        path = mount_point

        def mount(self, kib: int) -> None:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mount_point)],
                                  capture_output=True, text=True)
            if done.returncode:
                message = f"cannot mount a tmpfs here (root is needed): {done.stderr.strip()}"
                if os.environ.get("TRAINER_REQUIRE_TMPFS"):
                    pytest.fail(message)
                pytest.skip(message)

        def remount(self, options: str) -> None:
            subprocess.run(["mount", "-o", f"remount,{options}", str(mount_point)], check=True)

    yield Disk()
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def record(dump: Path) -> dict:
    return json.loads((dump / "run_meta.json").read_text())


def test_a_disk_that_fills_up_while_saving(disk):
    """Step-2 fits, step-4 does not: exit 2 (not restarted) with `no space left on device`
    named instead of torch's "unexpected pos"; step-2 is kept. With space again, the same command
    resumes from step-2, each step once."""
    disk.mount(6 * 1024)
    dump = disk.path / "run"
    args = [*TINY_JOB, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.no_last_save_model_only", "--job.dump_folder", str(dump)]
    full = launch(2, args)
    assert full.returncode == 2, describe(full)
    assert "error: rank" in full.stderr and "checkpoint step-4 could not be written" in full.stderr
    assert "no space left on device: " in full.stderr and "step-2, the newest complete checkpoint, is intact" in full.stderr
    assert "restart" not in full.stderr
    assert sorted(p.name for p in (dump / "checkpoint").iterdir() if "step" in p.name) == ["step-2"]
    assert record(dump)["status"] == "failed" and "no space left on device" in record(dump)["error"]

    disk.remount("size=16m")
    again = launch(2, args)
    assert again.returncode == 0, describe(again)
    assert [row["step"] for row in read_metrics(dump)] == list(range(1, 7))
    assert record(dump)["status"] == "completed"


def test_exports_on_a_full_disk_and_an_export_renamed_but_not_recorded(disk):
    """The final checkpoint fits, its model_only export does not: exit 2, the checkpoint is kept
    and the message says so; with space again the next start writes the export (training
    nothing) and completes the record. Then: killed after the export's rename and before
    checkpoint.json listed it, the next start records it instead of failing on its folder."""
    disk.mount(4400)
    dump = disk.path / "run"
    args = [*TINY_JOB, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "10",
            "--job.dump_folder", str(dump)]
    full = launch(1, args)
    assert full.returncode == 2, describe(full)
    final = dump / "checkpoint" / "step-4"
    assert (f"the model_only export of {final} could not be written: no space left on device" in full.stderr
            and f"{final} itself is complete" in full.stderr), describe(full)
    assert "restart" not in full.stderr and not (final / ".model_only.partial").exists()
    assert record(dump)["status"] == "failed"

    disk.remount("size=8m")
    written = launch(1, args)
    assert written.returncode == 0, describe(written)
    assert "nothing to do but its exports, written now (model_only)" in written.stdout, describe(written)
    assert (record(dump)["status"], record(dump)["completed_at_restart"]) == ("completed", True)
    assert "no space left" in record(dump)["error_before_restart"] and "error" not in record(dump)
    assert [row["step"] for row in read_metrics(dump)] == [1, 2, 3, 4]

    # The state a kill between the export's rename and the record's update leaves.
    checkpoint_record = json.loads((final / "checkpoint.json").read_text())
    (final / "checkpoint.json").write_text(json.dumps({**checkpoint_record, "exports": []}))
    settled = launch(1, args)
    assert settled.returncode == 0, describe(settled)
    assert "nothing to do" in settled.stdout and "Directory not empty" not in settled.stderr, describe(settled)
    assert json.loads((final / "checkpoint.json").read_text())["exports"] == ["model_only"]


@pytest.mark.smoke
def test_a_read_only_folder_is_refused_before_anything_starts(disk):
    """A dump folder on a read-only filesystem, new or existing: refused by the launcher (exit 2,
    no rank started), not a rank's crash restarted three times."""
    disk.mount(1024)
    (disk.path / "run").mkdir()
    disk.remount("ro")
    for name, message in (("new", "cannot be created (Read-only file system)"),
                          ("run", f"its lock {disk.path / 'run' / '.lock'} cannot be written (Read-only file system)")):
        result = launch(2, [*TINY_JOB, "--checkpoint.enable", "--job.dump_folder", str(disk.path / name)])
        assert result.returncode == 2, describe(result)
        assert f"error: job.dump_folder {disk.path / name}: {message}" in result.stderr, describe(result)
        assert "logs:" not in result.stdout
