"""`protocol run`'s progress lines say about how long the running run and the plan have left."""

from __future__ import annotations

import json
import re

from protocol.run.local import TimeLeft, duration, run_local


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_left_from_the_runs_pace_and_the_launches_done():
    clock = Clock()
    timer = TimeLeft(["a", "b", "c"], clock=clock)
    timer.reached("a")
    timer.start()
    clock.now = 20.0  # 10 of 100 steps in 20 s (start-up included): 180 s left; each launch ~200 s
    assert timer.left(10, 100) == ", about 3 min left in this run, about 10 min in the plan"
    clock.now = 30.0  # from the first line on, the pace leaves start-up out: 10 steps in 10 s
    assert timer.left(20, 100) == ", about 80 s left in this run, about 5 min in the plan"
    timer.took.append(100.0)  # "a" ran to its end in 100 s: the next ones are expected to take as long
    timer.reached("b")
    timer.start(from_step=50)  # resumed from a checkpoint at step 50
    clock.now = 130.0
    assert timer.left(60, 100) == ", about 7 min left in this run, about 8 min in the plan"
    timer.reached("c")  # the last launch: nothing more in the plan
    assert timer.left(60, 100) == ", about 7 min left in this run"


def test_durations_are_rounded_as_estimates():
    assert [duration(s) for s in (0.4, 7.6, 44.0, 89.0, 150.0, 5399.0, 9000.0)] == [
        "1 s", "8 s", "40 s", "90 s", "2 min", "90 min", "2.5 h"]


def test_a_running_run_reports_its_steps_and_the_time_left(small_plan, fake, tmp_path, monkeypatch):
    plan = small_plan(steps=8)
    monkeypatch.setenv("FAKE_SLEEP", json.dumps({"fsdp-tp2": 0.15}))
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake, progress_interval=0.05)
    assert [r.status for r in results] == ["completed"] * 4
    lines = [m for m in messages if ": step " in m]  # a loaded machine may show the others' steps too
    assert any(m.startswith("[3/4] FSDP+TP2: step ") for m in lines)
    pattern = (r"\[[23]/4\] (control|FSDP\+TP2): step [1-8]/8, about \d+ s left in this run, "
               r"about \d+ (s|min) in the plan")
    last = r"\[4/4\] lr x2: step [1-8]/8, about \d+ s left in this run"  # nothing after it: no plan part
    assert all(re.fullmatch(pattern, m) or re.fullmatch(last, m) for m in lines), lines
