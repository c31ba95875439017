"""Early stopping, searched sweeps and the sweep report, run through the fake launcher (local) and
a fake SLURM: which runs are launched, stopped and judged, and the numbers the report prints."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from protocol.cli import main
from protocol.plan.early_stop import STOP_MARKER
from protocol.plan.load import load_plan
from protocol.plan.measure import read_records
from protocol.run.local import run_local
from protocol.run.slurm import run_slurm
from tests.protocol.conftest import calls
from tests.protocol.fake_trainer import main as fake_main
from tests.protocol.test_launch import FakeSlurm

PLAN = """
[plan]
name = "rs"
config = "debug_model.toml"
output = "{output}"
steps = 6
warmup_steps = 1
local_batch_size = 4
dp_degree = 2
[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"optimizer.lr" = 3e-3
"validation.enable" = true
"validation.freq" = 2

{criterion}
{tables}

[[sweeps]]
name = "wd"
kind = "technique"
{sweep}
"""
# Five points, most communication first. The fake trainer's validation loss at step 6 is 5.82 plus
# the run's FAKE_OFFSET, so the criterion's bound is 5.82 x 1.02 = 5.9364: offset 0 meets it, 0.5 not.
WEIGHT_DECAYS = (0.0, 0.01, 0.02, 0.03, 0.04)
CRITERION = '[criterion]\nmetric = "validation/loss"\nmax_vs_control = 1.02\n'
GRID = 'grid = { "optimizer.weight_decay" = [0.0, 0.01] }'  # two points, no search


def points(count: int = 5) -> str:
    return "points = [" + ", ".join(f'{{ "optimizer.weight_decay" = {wd} }}' for wd in WEIGHT_DECAYS[:count]) + "]"


NAMES = [f"wd weight_decay={wd}" for wd in WEIGHT_DECAYS]
FOLDERS = [f"wd-weight-decay-{str(wd).replace('.', '-')}" for wd in WEIGHT_DECAYS]
SYNCS = {"control": 24, **dict(zip(FOLDERS, (24, 12, 6, 4, 3)))}


def write_plan(tmp_path: Path, tables: str = "", sweep: str = points() + '\nsearch = "bisect"',
               criterion: str = CRITERION):
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(output=tmp_path / "out", tables=tables, sweep=sweep, criterion=criterion))
    return load_plan(path)


def meeting(monkeypatch, k: int, worse: float = 0.5) -> None:
    """Points 1..k meet the criterion, the others miss it by `worse` nats; every run counts syncs."""
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({folder: 0.0 if i < k else worse for i, folder in enumerate(FOLDERS)}))
    monkeypatch.setenv("FAKE_SYNCS", json.dumps(SYNCS))
    monkeypatch.setenv("FAKE_STEP_TIME", json.dumps({"control": 0.5, FOLDERS[2]: 0.4}))


def launched(tmp_path: Path) -> list[str]:
    return [call["run"] for call in calls(tmp_path)]


@pytest.fixture
def fake_launcher(fake, monkeypatch):
    import protocol.run.local

    monkeypatch.setattr(protocol.run.local, "LAUNCHER", fake[0])
    return fake


# ---------------------------------------------------------------------------------------------
# Search


@pytest.mark.parametrize("k, ran, answer", [
    (3, [2, 3], "fewest syncs meeting the criterion: 6 (wd weight_decay=0.02)"),
    (5, [2, 3, 4], "fewest syncs meeting the criterion: 3 (wd weight_decay=0.04)"),
    (1, [2, 0, 1], "fewest syncs meeting the criterion: 24 (wd weight_decay=0.0)"),
    (0, [2, 0], "no set meets the criterion"),
])
def test_a_search_runs_only_the_points_the_bisection_needs(tmp_path, fake, monkeypatch, k, ran, answer):
    plan = write_plan(tmp_path)
    meeting(monkeypatch, k)
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake)
    assert launched(tmp_path) == ["seed", "control", *(FOLDERS[i] for i in ran)]
    status = {r.name: r.status for r in results}
    assert [status[name] for name in NAMES] == ["completed" if i in ran else "not needed" for i in range(5)]
    assert f"search 'wd': {'answer ' + NAMES[k - 1] if k else 'no point meets the criterion'} (ran: " \
           f"{', '.join(NAMES[i] for i in ran)}; not needed: " in messages[-3]
    # Run again: the same walk, every run reused.
    again = run_local(plan, plan.launches(), launcher=fake)
    assert len(calls(tmp_path)) == 2 + len(ran)
    assert [r.status for r in again if r.name in NAMES] == ["already complete" if i in ran else "not needed"
                                                           for i in range(5)]
    assert answer in sweep_output(plan, 0 if k else 1)


def sweep_output(plan, status: int) -> str:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["compare", str(plan.path)]) == status
    return out.getvalue()


def test_the_sweep_report_table_answer_and_figure(tmp_path, fake_launcher, monkeypatch, capsys):
    plan = write_plan(tmp_path)
    meeting(monkeypatch, 3)
    assert main(["run", str(plan.path), "--compare"]) == 0
    out = capsys.readouterr().out
    criterion = "criterion: validation/loss at step 6 <= 1.02 x control (5.82 -> 5.9364)"
    assert out.splitlines()[-1] == (f"PASS: {criterion}; sweep 'wd': fewest syncs meeting the criterion: 6 "
                                    "(wd weight_decay=0.02)")
    table = out[out.index("sweep 'wd':"):].splitlines()
    assert table[0] == "sweep 'wd':"
    assert table[1].split("  ")[0] == "set" and "validation/loss at step 6" in table[1]
    rows = [line.split() for line in table[3:9]]
    assert rows == [
        ["control", "24", "5.82", "-", "control", "0.5000"],
        ["wd", "weight_decay=0.0", "n/a", "n/a", "-", "not", "needed", "n/a"],
        ["wd", "weight_decay=0.01", "n/a", "n/a", "-", "not", "needed", "n/a"],
        ["wd", "weight_decay=0.02", "6", "5.82", "+0.00%", "yes", "0.4000"],
        ["wd", "weight_decay=0.03", "4", "6.32", "+8.59%", "no", "0.5000"],
        ["wd", "weight_decay=0.04", "n/a", "n/a", "-", "not", "needed", "n/a"]]
    assert table[9] == "wd: fewest syncs meeting the criterion: 6 (wd weight_decay=0.02)"
    assert table[10].startswith("search 'wd': answer wd weight_decay=0.02 (ran: wd weight_decay=0.02, wd "
                                "weight_decay=0.03; not needed: wd weight_decay=0.0, wd weight_decay=0.01, wd "
                                "weight_decay=0.04)")
    # The report states the criterion with its margin (this plan runs no noise controls to measure it in)
    stated = (f"{criterion} [margin +0.116 nats above the control; no noise measured: the plan has no noise "
              "controls (exact mode); run them with [tolerance] mode = \"statistical\"]")
    data = json.loads((plan.output / "sweep_report.json").read_text())
    assert data["criterion"] == stated and data["sweeps"][0]["figure"] == "sweep-wd.png"
    rows = {row["name"]: row for row in data["sweeps"][0]["rows"]}
    assert rows["wd weight_decay=0.03"]["vs_control"] == pytest.approx(0.5 / 5.82)
    assert rows["wd weight_decay=0.03"]["meets"] == "no" and rows["wd weight_decay=0.02"]["step_time"] == 0.4
    assert (plan.output / "sweep-wd.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (plan.output / "sweep_report.md").read_text()
    assert f"**{stated}**" in markdown and "| wd weight_decay=0.03 | 4 | 6.32 | +8.59% | no | 0.5000 |" in markdown
    report = (plan.output / "report.md").read_text()
    assert f"Decision: {stated} decides every set" in report
    assert "- **wd weight_decay=0.03**: validation/loss at step 6 = 6.32 > 5.9364: misses the criterion" in report
    assert "- **wd weight_decay=0.02**: validation/loss at step 6 = 5.82 <= 5.9364: meets the criterion" in report
    verdicts = json.loads((plan.output / "report.json").read_text())
    assert [(r["name"], r["outcome"]) for r in verdicts["results"]] == [
        ("wd weight_decay=0.02", "meets criterion"), ("wd weight_decay=0.03", "misses criterion")]
    assert verdicts["not_compared"] == [] and verdicts["status"] == "PASS"
    from protocol.report.as_json import comparison_from_dict
    from protocol.report.markdown import status_line

    again = comparison_from_dict(verdicts)  # report.json reads back with the criterion's verdict
    assert again.criterion == stated and status_line(again) == out.splitlines()[-1]
    assert [r.outcome for r in again.results] == ["meets criterion", "misses criterion"]


def test_without_counted_syncs_the_answer_is_the_last_point_meeting_it(tmp_path, fake_launcher, monkeypatch, capsys):
    plan = write_plan(tmp_path, sweep='grid = { "optimizer.weight_decay" = [0.0, 0.01, 0.02] }')
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({FOLDERS[2]: 0.5}))
    assert main(["run", str(plan.path), "--compare"]) == 0
    out = capsys.readouterr().out
    assert ("wd: fewest syncs meeting the criterion: not counted (set metrics.count_collectives = true); the last "
            "point in the sweep's order that meets it: wd weight_decay=0.01") in out
    assert len(calls(tmp_path)) == 5  # no search: every point ran
    assert not (plan.output / "sweep-wd.png").exists()  # nothing to draw against syncs


def test_a_set_that_misses_the_criterion_fails_the_plan(tmp_path, fake_launcher, monkeypatch, capsys):
    tables = '[[sets]]\nname = "wd high"\nkind = "technique"\noverrides = { "optimizer.weight_decay" = 0.5 }\n'
    plan = write_plan(tmp_path, tables=tables, sweep='grid = { "optimizer.weight_decay" = [0.0] }')
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({"wd-high": 0.2}))
    assert main(["run", str(plan.path), "--compare"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "FAIL: wd high (criterion: validation/loss at step 6 <= 1.02 x control (5.82 -> 5.9364))"


def test_an_absolute_train_loss_criterion_and_a_positive_control_that_meets_it(tmp_path, fake_launcher, monkeypatch,
                                                                            capsys):
    # Training loss at steps 4-6: 4.88, 4.85, 4.82 (+ the run's offset): mean 4.85 <= 5.0.
    tables = '[[sets]]\nname = "bug"\nkind = "technique"\nexpect = "fail"\noverrides = { "optimizer.beta1" = 0.5 }\n'
    criterion = '[criterion]\nmetric = "loss"\nwindow = 3\nmax = 5.0\n'
    plan = write_plan(tmp_path, tables=tables, sweep=GRID,
                      criterion=criterion)
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({FOLDERS[1]: 0.5}))
    assert main(["run", str(plan.path), "--compare"]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("INCONCLUSIVE: positive control bug meets the criterion: train loss mean over "
                                    "steps 4-6 <= 5, so the criterion cannot tell a bug of that size")
    assert "wd: fewest syncs meeting the criterion: not counted" in out
    report = (plan.output / "report.md").read_text()
    assert "- **wd weight_decay=0.01**: train loss mean over steps 4-6 = 5.35 > 5: misses the criterion" in report


# ---------------------------------------------------------------------------------------------
# Early stopping

RULE = '[[early_stop]]\nstep = 2\nmetric = "validation/loss"\nabove = {above}\n'


def test_a_run_breaking_a_rule_is_stopped_marked_and_not_run_again(tmp_path, fake, monkeypatch):
    # Validation loss at step 2: 5.94 + offset. The second point (offset 0.5: 6.44) breaks the rule.
    plan = write_plan(tmp_path, tables=RULE.format(above=6.2), sweep=points(3))
    assert [s.name for s in plan.sets] == NAMES[:3]
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({FOLDERS[1]: 0.5}))
    monkeypatch.setenv("FAKE_SLEEP", json.dumps({FOLDERS[1]: 0.2}))
    messages: list[str] = []
    results = run_local(plan, plan.launches(), on_progress=messages.append, launcher=fake, progress_interval=0.05)
    assert [r.status for r in results] == ["completed", "completed", "completed", "stopped", "completed"]
    stopped = results[3]
    assert stopped.message.startswith("early_stop[0]: validation/loss at step 2 = 6.44 > 6.2 (stopped at step ")
    folder = plan.output / FOLDERS[1]
    assert read_records(folder).last_step < 6  # ended before its last step
    marker = json.loads((folder / STOP_MARKER).read_text())
    assert marker["rule"] == {"metric": "validation/loss", "step": 2, "window": None, "above": 6.2}
    assert marker["value"] == pytest.approx(6.44)
    assert any(m.startswith(f"[4/5] {NAMES[1]}: STOPPED after ") for m in messages)
    assert messages[-2:] == [f"{NAMES[1]}: STOPPED ({stopped.message})", "4 runs complete, 1 stopped"]
    # The same rules: not run again, still stopped.
    again = run_local(plan, plan.launches(), launcher=fake, progress_interval=0.05)
    assert len(calls(tmp_path)) == 5 and again[3].status == "stopped" and again[3].message == stopped.message
    # A looser rule: it runs again (resuming in its folder) and finishes.
    plan = write_plan(tmp_path, tables=RULE.format(above=7.0), sweep=points(3))
    monkeypatch.setenv("FAKE_SLEEP", "{}")
    third = run_local(plan, plan.launches(), launcher=fake, progress_interval=0.05)
    assert launched(tmp_path)[5:] == [FOLDERS[1]] and third[3].status == "completed"
    assert not (folder / STOP_MARKER).exists()


def test_a_stopped_point_is_reported_stopped_not_failed(tmp_path, fake_launcher, monkeypatch, capsys):
    plan = write_plan(tmp_path, tables=RULE.format(above=6.2), sweep=points(3))
    run_stopped(plan, tmp_path, monkeypatch)
    assert main(["compare", str(plan.path)]) == 0  # a point is a measurement: its stop is a finding
    out = capsys.readouterr().out
    row = next(line for line in out[out.index("sweep 'wd':"):].splitlines() if line.startswith(NAMES[1] + " "))
    assert re.split(r"\s{2,}", row) == [NAMES[1], "12", "n/a", "-", "STOPPED", "0.5000"]
    data = json.loads((plan.output / "report.json").read_text())
    assert [(m["name"], m["verdict"]) for m in data["not_compared"]] == [(NAMES[1], "STOPPED")]
    assert data["not_compared"][0]["reason"].startswith("early_stop[0]: validation/loss at step 2 = 6.44 > 6.2")
    markdown = (plan.output / "sweep_report.md").read_text()
    assert f"- {NAMES[1]}: early_stop[0]: validation/loss at step 2 = 6.44 > 6.2" in markdown
    assert "fewest syncs meeting the criterion: 6 (wd weight_decay=0.02)" in markdown


def test_without_a_criterion_a_stopped_set_is_a_stopped_row_that_fails_the_plan(tmp_path, fake_launcher,
                                                                                 monkeypatch, capsys):
    plan = write_plan(tmp_path, tables=RULE.format(above=6.2), sweep=GRID,
                      criterion="")
    run_stopped(plan, tmp_path, monkeypatch)
    assert main(["compare", str(plan.path)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"FAIL: {NAMES[1]}"
    assert any(line.startswith(NAMES[1]) and line.rstrip().endswith("STOPPED") for line in out.splitlines())


def run_stopped(plan, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({FOLDERS[1]: 0.5}))
    monkeypatch.setenv("FAKE_SYNCS", json.dumps(SYNCS))
    monkeypatch.setenv("FAKE_SLEEP", json.dumps({FOLDERS[1]: 0.2}))
    results = run_local(plan, plan.launches(), launcher=[str(tmp_path / "fake_launcher")], progress_interval=0.05)
    assert {r.name: r.status for r in results}[NAMES[1]] == "stopped"


# ---------------------------------------------------------------------------------------------
# SLURM


class SlurmWritingWhileRunning(FakeSlurm):
    """A job writes its run when it starts, so a rule can be checked while it is RUNNING."""

    def advance(self):
        for job in self.jobs.values():
            if job["state"] == "PENDING" and all(self.jobs[a]["state"] == "COMPLETED" for a in job["after"]):
                job["state"] = "RUNNING"
                launch = job["launch"]
                os.environ["NGPU"] = str(launch.nproc)
                fake_main(list(launch.args))
            elif job["state"] == "RUNNING":
                job["state"] = "COMPLETED"


@pytest.fixture
def slurm_env(fake, monkeypatch):
    monkeypatch.setenv("NGPU", "1")


def test_slurm_cancels_a_running_job_that_breaks_a_rule(tmp_path, slurm_env, monkeypatch):
    plan = write_plan(tmp_path, tables=RULE.format(above=6.2), sweep=GRID)
    monkeypatch.setenv("FAKE_OFFSET", json.dumps({FOLDERS[1]: 0.5}))
    slurm = SlurmWritingWhileRunning(plan)
    messages: list[str] = []
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=slurm, poll=0, on_progress=messages.append,
                        sleep=lambda s: None)
    assert [(r.name, r.status) for r in results] == [("seed", "completed"), ("control", "completed"),
                                                     (NAMES[0], "completed"), (NAMES[1], "stopped")]
    assert ["scancel", "503"] in slurm.commands and (plan.output / FOLDERS[1] / STOP_MARKER).is_file()
    assert f"{NAMES[1]}: STOPPED (job 503 cancelled) by early_stop[0]: validation/loss at step 2 = 6.44 > 6.2 " \
           "(stopped at step 6)" in messages
    # Submitted again: the stopped run is not.
    again = SlurmWritingWhileRunning(plan)
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=again, poll=0, sleep=lambda s: None)
    assert again.commands == [] and results[3].status == "stopped"


def test_slurm_searches_one_job_at_a_time(tmp_path, slurm_env, monkeypatch):
    plan = write_plan(tmp_path)
    meeting(monkeypatch, 3)
    slurm = FakeSlurm(plan)
    results = run_slurm(plan, plan.launches(), tmp_path / "slurm", runner=slurm, poll=0, sleep=lambda s: None)
    submitted = [Path(c[-1]).stem for c in slurm.commands if c[0] == "sbatch"]
    assert submitted == ["seed", "control", FOLDERS[2], FOLDERS[3]]
    assert [r.status for r in results[2:]] == ["not needed", "not needed", "completed", "completed", "not needed"]
