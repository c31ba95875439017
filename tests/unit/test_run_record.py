"""Unit tests of trainer.run_record: one record per run, kept with its metrics across starts."""

from __future__ import annotations

import json
import os
from datetime import datetime

from trainer import run_record
from trainer.run_record import METRICS_FILE, RECORD_FILE, begin, finish, read_record


def write_metrics(folder, lines: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS_FILE).write_text("".join(lines))


def step_line(step: int, loss: float = 5.0, **extra) -> str:
    return json.dumps({"step": step, "loss": loss, **extra}) + "\n"


def test_a_new_run_moves_the_previous_record_and_metrics_together(tmp_path):
    first = begin(tmp_path, {"config": {"optimizer": {"lr": 0.006}}}, resumed_step=0)
    write_metrics(tmp_path, [step_line(1), step_line(2)])
    finish(tmp_path, first, "completed", 2)
    mtime = datetime(2026, 5, 6, 7, 8, 9).timestamp()
    for name in (RECORD_FILE, METRICS_FILE):
        os.utime(tmp_path / name, (mtime, mtime))

    second = begin(tmp_path, {"config": {"optimizer": {"lr": 0.003}}}, resumed_step=0)
    moved = tmp_path / "previous" / "20260506-070809"
    assert sorted(p.name for p in moved.iterdir()) == [METRICS_FILE, RECORD_FILE]
    assert read_record(moved)["config"]["optimizer"]["lr"] == 0.006 and read_record(moved)["status"] == "completed"
    assert not (tmp_path / METRICS_FILE).exists()
    assert second["history"] == [] and read_record(tmp_path)["config"]["optimizer"]["lr"] == 0.003

    # the next new run whose files carry the same time stamp gets its own folder
    write_metrics(tmp_path, [step_line(1)])
    for name in (RECORD_FILE, METRICS_FILE):
        os.utime(tmp_path / name, (mtime, mtime))
    begin(tmp_path, {}, resumed_step=0)
    assert read_record(tmp_path / "previous" / "20260506-070809-1")["config"]["optimizer"]["lr"] == 0.003


def test_a_resume_keeps_history_and_each_step_once(tmp_path):
    first = begin(tmp_path, {"config": {"training": {"steps": 20}}, "start": {"kind": "init"}}, resumed_step=0)
    # logged up to step 12 before a crash; the newest checkpoint is step 10; the last line is torn
    write_metrics(tmp_path, [step_line(s) for s in range(1, 13)] + [step_line(10, kind="validation"),
                                                                    '{"step": 13, "lo'])
    resumed = begin(tmp_path, {"config": {"training": {"steps": 20}}, "start": {"kind": "resume"}}, resumed_step=10)
    kept = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in kept] == [*range(1, 11), 10] and kept[-1]["kind"] == "validation"
    (moved,) = (tmp_path / "previous").glob("*-after-step-10")
    assert (moved / METRICS_FILE).read_text().splitlines() == [step_line(11).strip(), step_line(12).strip(),
                                                               '{"step": 13, "lo']
    assert resumed["start"] == {"kind": "resume"} and resumed["last_step"] == 10
    assert [(r["status"], r["start"]) for r in resumed["history"]] == [("running", {"kind": "init"})]
    assert first["history"] == []

    done = finish(tmp_path, resumed, "completed", 20)
    assert read_record(tmp_path) == done and done["status"] == "completed" and done["ended"]
    again = begin(tmp_path, {}, resumed_step=20)  # a third start keeps both earlier ones, oldest first
    assert [r["status"] for r in again["history"]] == ["running", "completed"]
    assert all("history" not in r for r in again["history"])


def test_a_resume_with_nothing_to_drop_moves_nothing(tmp_path):
    write_metrics(tmp_path, [step_line(1), step_line(2)])
    begin(tmp_path, {}, resumed_step=2)
    assert not (tmp_path / "previous").exists()
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 2


def test_record_is_written_atomically_and_read_back(tmp_path):
    run_record.write_record(tmp_path / "out", {"dtype": object.__new__(type("Dtype", (), {"__str__": lambda s: "bf16"}))})
    assert json.loads((tmp_path / "out" / RECORD_FILE).read_text()) == {"dtype": "bf16"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [RECORD_FILE]
    (tmp_path / "out" / RECORD_FILE).write_text("{not json")
    assert read_record(tmp_path / "out") is None and read_record(tmp_path / "nowhere") is None
