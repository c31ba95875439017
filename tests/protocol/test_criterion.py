"""[criterion], [[early_stop]] and searched [[sweeps]] as a plan reads them, the numbers read from
a run folder, and the bisection (no runs here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from protocol.plan.criteria import Criterion, Measure
from protocol.plan.load import PlanError, load_plan
from protocol.plan.measure import mean_step_time, measure, read_records, syncs_per_forward
from protocol.plan.search import bisect

PLAN = """
[plan]
name = "rs"
config = "debug_model.toml"
output = "{output}"
steps = 20
local_batch_size = 4
dp_degree = 2
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32, "metrics.log_freq" = 5 {validation} }}

{tables}

[[sweeps]]
name = "wd"
kind = "technique"
{sweep}
"""
VALIDATION = ', "validation.enable" = true, "validation.freq" = 5'
CRITERION = '[criterion]\nmetric = "validation/loss"\nmax_vs_control = 1.02\n'
POINTS = 'points = [{ "optimizer.weight_decay" = 0.0 }, { "optimizer.weight_decay" = 0.1, "optimizer.beta1" = 0.8 }]'


def write(tmp_path: Path, tables: str = CRITERION, sweep: str = POINTS, validation: str = VALIDATION) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(output=tmp_path / "out", tables=tables, sweep=sweep, validation=validation))
    return path


def problems(tmp_path: Path, **parts) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(write(tmp_path, **parts))
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Reading the plan


def test_a_relative_criterion_defaults_to_the_last_step_and_names_itself(tmp_path):
    plan = load_plan(write(tmp_path))
    assert plan.criterion == Criterion(Measure("validation/loss", 20), max_vs_control=1.02)
    assert plan.criterion.describe() == "validation/loss at step 20 <= 1.02 x control"
    assert plan.criterion.describe(3.28) == "validation/loss at step 20 <= 1.02 x control (3.28 -> 3.3456)"
    assert plan.criterion.threshold(3.28) == pytest.approx(3.3456)
    assert plan.early_stop == ()


def test_an_absolute_train_loss_criterion_and_early_stop_rules(tmp_path):
    tables = ('[criterion]\nmetric = "loss"\nstep = 15\nwindow = 10\nmax = 3.35\n'
              '[[early_stop]]\nstep = 5\nmetric = "validation/loss"\nabove = 3.8\n'
              '[[early_stop]]\nstep = 10\nmetric = "loss"\nwindow = 5\nabove = 4\n')
    plan = load_plan(write(tmp_path, tables=tables))
    assert plan.criterion.describe() == "train loss mean over steps 6-15 <= 3.35"
    assert plan.criterion.threshold(None) == 3.35 and not plan.criterion.relative
    assert [rule.describe() for rule in plan.early_stop] == [
        "early_stop[0]: stop when validation/loss at step 5 > 3.8",
        "early_stop[1]: stop when train loss mean over steps 6-10 > 4"]


@pytest.mark.parametrize("tables, validation, message", [
    ('[criterion]\nmetric = "validation_loss"\nmax = 3\n', VALIDATION,
     "criterion.metric: 'validation_loss' is not one of 'validation/loss', 'loss'; did you mean 'validation/loss'?"),
    ('[criterion]\nmetric = "loss"\nwindow = 5\nmax = 3\nmax_vs_control = 1.02\n', VALIDATION,
     "criterion: give one bound, not max and max_vs_control: max (an absolute bound: metric <= max), max_vs_control"),
    ('[criterion]\nmetric = "loss"\nwindow = 5\n', VALIDATION, "criterion.max: missing: give max = 3.35"),
    ('[criterion]\nmetric = "loss"\nwindow = 5\nmax_vs_control = 0\n', VALIDATION,
     "criterion.max_vs_control: a factor of the control's value, must be > 0, got 0.0"),
    ('[criterion]\nmetric = "loss"\nwindow = 5\nmax = "3"\n', VALIDATION, "criterion.max: expected a number, got '3'"),
    ('[criterion]\nmetric = "validation/loss"\nstep = 25\nmax = 3\n', VALIDATION,
     "criterion.step: 25 is beyond the training steps (plan.steps = 20); choose a step in 1..20"),
    ('[criterion]\nmetric = "validation/loss"\nstep = 12\nmax = 3\n', VALIDATION,
     "criterion.step: the runs validate every 5 steps (validation.freq) and at the last step 20, not at step 12; "
     "use a multiple of 5 or 20"),
    ('[criterion]\nmetric = "validation/loss"\nmax = 3\n', "",
     "criterion.metric: 'validation/loss' needs validation in every run; set \"validation.enable\" = true in "
     "plan.overrides"),
    ('[criterion]\nmetric = "validation/loss"\nwindow = 3\nmax = 3\n', VALIDATION,
     "criterion.window: only for metric = 'loss'"),
    ('[criterion]\nmetric = "loss"\nmax = 3\n', VALIDATION, "criterion.window: missing: metric = 'loss' is the mean"),
    ('[criterion]\nmetric = "loss"\nstep = 14\nwindow = 3\nmax = 3\n', VALIDATION,
     "criterion.window: no training step in 12..14 is logged (metrics.log_freq = 5); widen the window"),
    ('[criterion]\nmetric = "loss"\nstep = 4\nwindow = 6\nmax = 3\n', VALIDATION,
     "criterion.window: 6 steps ending at step 4 would start before step 1; at most 4"),
    ('[criterion]\nmetric = "loss"\nwindow = 5\nmax_vs_contrl = 1.02\n', VALIDATION,
     "criterion.max_vs_contrl: unknown key; did you mean 'max_vs_control'?"),
    (CRITERION + '[[early_stop]]\nstep = 30\nmetric = "validation/loss"\nabove = 3.8\n', VALIDATION,
     "early_stop[0].step: 30 is beyond the training steps (plan.steps = 20)"),
    (CRITERION + '[[early_stop]]\nstep = 5\nmetric = "validation/loss"\n', VALIDATION,
     "early_stop[0].above: missing (required): The run is stopped when its metric at `step` is above this."),
    (CRITERION + '[early_stop]\nstep = 5\n', VALIDATION, "early_stop: expected an array of tables ([[early_stop]])"),
])
def test_criterion_and_rule_mistakes_name_the_key(tmp_path, tables, validation, message):
    assert message in problems(tmp_path, tables=tables, validation=validation)


def test_mistakes_of_every_table_are_listed_at_once(tmp_path):
    tables = ('[criterion]\nmetric = "validation/loss"\nstep = 25\nmax = 3\n'
              '[[early_stop]]\nstep = 7\nmetric = "validation/loss"\nabove = 4\n')
    found = problems(tmp_path, tables=tables)
    assert "2 problems" in found and "criterion.step: 25" in found and "early_stop[0].step: the runs validate" in found


def test_points_are_an_ordered_list_of_sets_and_a_search_marks_them(tmp_path):
    plan = load_plan(write(tmp_path, sweep=POINTS + '\nsearch = "bisect"\noverrides = { "optimizer.lr" = 1e-3 }'))
    assert [s.name for s in plan.sets] == ["wd weight_decay=0.0", "wd weight_decay=0.1 beta1=0.8"]
    assert plan.sets[1].overrides == {"optimizer.lr": 1e-3, "optimizer.weight_decay": 0.1, "optimizer.beta1": 0.8}
    assert [s.sweep for s in plan.sets] == ["wd", "wd"]
    assert [(sweep.name, sweep.points, sweep.search) for sweep in plan.sweeps] == [
        ("wd", ("wd weight_decay=0.0", "wd weight_decay=0.1 beta1=0.8"), "bisect")]
    assert [(launch.name, launch.search) for launch in plan.launches()] == [
        ("seed", False), ("control", False), ("wd weight_decay=0.0", True), ("wd weight_decay=0.1 beta1=0.8", True)]
    from protocol.run.render import render

    table = render(plan, plan.launches(), "table")
    assert table.endswith("criterion: validation/loss at step 20 <= 1.02 x control (judges every set: pass = meets "
                          "it)\n"
                          "search 'wd' (bisect): run on demand by `protocol run`, only the points the bisection "
                          "needs, in this order (most communication first): wd weight_decay=0.0, wd weight_decay=0.1 "
                          "beta1=0.8")
    assert json.loads(render(plan, plan.launches(), "json"))[2]["search"] is True


def test_a_point_may_name_itself(tmp_path):
    sweep = 'points = [{ name = "none", "optimizer.weight_decay" = 0.0 }, { "optimizer.weight_decay" = 0.1 }]'
    plan = load_plan(write(tmp_path, sweep=sweep))
    assert [s.name for s in plan.sets] == ["wd none", "wd weight_decay=0.1"]
    assert plan.sets[0].overrides == {"optimizer.weight_decay": 0.0}


@pytest.mark.parametrize("tables, sweep, message", [
    (CRITERION, 'points = [{ name = 3, "optimizer.lr" = 1e-3 }]',
     "sweeps[0].points[0].name: expected a non-empty string, got 3"),
    ("", POINTS + '\nsearch = "bisect"', "sweeps[0].search: a search looks for the last point that meets the "
                                         "criterion; add a [criterion] table"),
    (CRITERION, 'grid = { "optimizer.lr" = [1e-3], "optimizer.weight_decay" = [0.0] }\nsearch = "bisect"',
     "sweeps[0].search: a bisection needs one ordered axis, but the grid has 2 keys"),
    (CRITERION, POINTS + '\nsearch = "binary"', "sweeps[0].search: 'binary' is not one of 'bisect'"),
    (CRITERION, POINTS + '\ngrid = { "optimizer.lr" = [1e-3] }', "sweeps[0]: give grid (every combination of "
                                                                "values) or points (an ordered list), not both"),
    (CRITERION, 'points = []', "sweeps[0].points: empty"),
    (CRITERION, 'points = [{ "optimizer.lr" = 1e-3 }, {}]', "sweeps[0].points[1]: empty"),
    (CRITERION, 'points = [1, 2]', "sweeps[0].points: expected an array of tables, got [1, 2]"),
    (CRITERION, 'points = [{ "optimizer.lr" = 1e-3 }, { "optimizer.lrr" = 2e-3 }]',
     'sweeps[0].points[1]."optimizer.lrr": unknown option optimizer.lrr'),
    (CRITERION, '', "sweeps[0].grid: missing: give a grid of values"),
])
def test_sweep_points_and_search_mistakes(tmp_path, tables, sweep, message):
    assert message in problems(tmp_path, tables=tables, sweep=sweep)


# ---------------------------------------------------------------------------------------------
# Numbers of a run folder


def write_metrics(folder: Path, lines: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 9, "lo')
    return folder


def test_measures_read_a_running_or_resumed_runs_metrics(tmp_path):
    folder = write_metrics(tmp_path / "run", [
        {"step": 1, "loss": 9.0, "step_time_s": 5.0}, {"step": 5, "loss": 4.0, "step_time_s": 1.0},
        {"step": 5, "kind": "validation", "validation/loss": 4.5},
        {"step": 10, "loss": 3.9, "step_time_s": 1.0},
        {"step": 10, "loss": 3.0, "step_time_s": 2.0},  # a resumed run logs it again: the last wins
        {"step": 10, "kind": "collectives", "collectives/tp_forward": 26},
        {"step": 20, "loss": 2.0, "step_time_s": 4.0}])
    records = read_records(folder)  # the half-written last line is skipped
    assert measure(records, Measure("validation/loss", 5)).value == 4.5
    assert measure(records, Measure("validation/loss", 10)).missing == \
        "no validation/loss at step 10 (last validation at step 5)"
    assert measure(records, Measure("loss", 10, window=6)).value == pytest.approx(3.5)  # steps 5 and 10
    assert measure(records, Measure("loss", 25, window=5)).missing == "the run reached step 20, not 25"
    assert measure(records, Measure("loss", 14, window=3)).missing == "no training loss logged in steps 12-14"
    # step time after a warm-up of 5 steps: (10 - 5) steps at 2 s and (20 - 10) at 4 s
    assert mean_step_time(records, 5) == pytest.approx((5 * 2 + 10 * 4) / 15)
    assert mean_step_time(records, 0) == pytest.approx((4 * 1 + 5 * 2 + 10 * 4) / 19)  # step 1 always left out
    assert mean_step_time(read_records(tmp_path / "none"), 0) is None
    assert syncs_per_forward({"collectives": {"tp_syncs_per_forward": 6.0}}) == 6.0
    assert syncs_per_forward({"status": "completed"}) is None and syncs_per_forward(None) is None


# ---------------------------------------------------------------------------------------------
# The bisection


@pytest.mark.parametrize("count", range(1, 10))
def test_bisection_finds_the_last_point_meeting_the_criterion_in_log2_runs(count):
    for k in range(count + 1):  # points 0..k-1 meet the criterion
        visited, answer, blocked = bisect(count, lambda i: i < k)
        assert answer == (k - 1 if k else None) and blocked is None
        assert len(visited) == len(set(visited)) <= math.ceil(math.log2(count + 1))


def test_bisection_of_five_points_runs_the_middle_first_and_stops_at_a_point_it_cannot_judge():
    assert bisect(5, lambda i: i < 3) == ([2, 3], 2, None)  # 0, 1, 2 meet: 2 meets, 3 misses
    assert bisect(5, lambda i: i < 1) == ([2, 0, 1], 0, None)
    assert bisect(5, lambda i: i < 5) == ([2, 3, 4], 4, None)
    assert bisect(5, lambda i: False) == ([2, 0], None, None)
    assert bisect(5, lambda i: None if i == 0 else i < 1) == ([2, 0], None, 0)
