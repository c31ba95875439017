"""Unit tests of trainer.records.run_meta: one record per run, kept with its metrics across starts."""

from __future__ import annotations

import json
import os
from datetime import datetime

from trainer.records import run_meta
from trainer.records.run_meta import METRICS_FILE, RECORD_FILE, begin, finish, read_record


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
    run_meta.write_record(tmp_path / "out", {"dtype": object.__new__(type("Dtype", (), {"__str__": lambda s: "bf16"}))})
    assert json.loads((tmp_path / "out" / RECORD_FILE).read_text()) == {"dtype": "bf16"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [RECORD_FILE]
    (tmp_path / "out" / RECORD_FILE).write_text("{not json")
    assert read_record(tmp_path / "out") is None and read_record(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------------------------------
# Sequences of starts in one folder: metrics.jsonl holds one trajectory whatever came before.


def start(folder, name: str, lineage: str, resumed_step: int, last_step: int, ancestors=()) -> None:
    """A start of trajectory `lineage` from step `resumed_step` that logs steps up to
    `last_step`, each line tagged with `name`."""
    trajectory = {"lineage": lineage, "ancestors": [{"lineage": a, "until_step": s} for a, s in ancestors]}
    record = begin(folder, {"name": name}, resumed_step, trajectory)
    with open(folder / METRICS_FILE, "a") as f:
        f.writelines(json.dumps({"step": s, "run": name}) + "\n" for s in range(resumed_step + 1, last_step + 1))
    finish(folder, record, "completed", last_step)


def curve(folder) -> list[tuple[int, str]]:
    return [(r["step"], r["run"]) for r in map(json.loads, (folder / METRICS_FILE).read_text().splitlines())]


def kept_curves(folder) -> list[list[tuple[int, str]]]:
    return sorted(curve(p) for p in (folder / "previous").iterdir() if (p / RECORD_FILE).is_file())


def steps(name: str, first: int, last: int) -> list[tuple[int, str]]:
    return [(s, name) for s in range(first, last + 1)]


def test_a_run_without_checkpoints_between_a_run_and_its_resume(tmp_path):
    start(tmp_path, "A", "L1", 0, 6)
    start(tmp_path, "B", "L2", 0, 2)  # another run (no checkpoints: its own lineage)
    start(tmp_path, "A'", "L1", 6, 9)  # resumes A's checkpoint of step 6
    assert curve(tmp_path) == steps("A", 1, 6) + steps("A'", 7, 9)
    assert kept_curves(tmp_path) == [steps("A", 1, 6), steps("B", 1, 2)]
    assert [r["name"] for r in read_record(tmp_path)["history"]] == ["A"]


def test_a_branch_that_saves_nothing_then_a_resume_of_the_newest_checkpoint(tmp_path):
    start(tmp_path, "A", "L1", 0, 6)
    start(tmp_path, "C", "L3", 3, 6, ancestors=[("L1", 3)])  # load_step 3, load_only
    assert curve(tmp_path) == steps("A", 1, 3) + steps("C", 4, 6)
    start(tmp_path, "A'", "L1", 6, 9)
    assert curve(tmp_path) == steps("A", 1, 6) + steps("A'", 7, 9)
    assert steps("A", 1, 3) + steps("C", 4, 6) in kept_curves(tmp_path)


def test_a_rewind_and_a_restart_continue_their_own_curve(tmp_path):
    start(tmp_path, "A", "L1", 0, 8)
    start(tmp_path, "D", "L4", 4, 6, ancestors=[("L1", 4)])  # load_step 4 --overwrite: a new lineage
    assert curve(tmp_path) == steps("A", 1, 4) + steps("D", 5, 6)
    start(tmp_path, "D'", "L4", 5, 7)  # restarted after a crash at step 6, from its step-5 checkpoint
    assert curve(tmp_path) == steps("A", 1, 4) + steps("D", 5, 5) + steps("D'", 6, 7)
    assert [r["name"] for r in read_record(tmp_path)["history"]] == ["A", "D"]


def test_a_start_from_a_checkpoint_recorded_elsewhere_starts_its_curve_after_it(tmp_path):
    start(tmp_path, "A", "L1", 0, 4)
    start(tmp_path, "E", "L9", 10, 12, ancestors=[("L8", 10)])  # initial_load_path of another folder's step-10
    assert curve(tmp_path) == steps("E", 11, 12)
    assert read_record(tmp_path)["metrics_from_step"] == 11 and kept_curves(tmp_path) == [steps("A", 1, 4)]
