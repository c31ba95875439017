"""A [criterion] in units of noise (max_sigmas_above_control) and every criterion's margin in noise
SDs: the bound and the judgement from run folders written here, the plan refused without noise
controls, the margin printed beside the criterion, and the warning of a loose criterion."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

import protocol.run.reuse
from protocol.plan.judging import family_noise, judge_plan, threshold
from protocol.plan.load import PlanError, load_plan
from protocol.run.reuse import Now
from protocol.verdict.by_criterion import judge_by_criterion
from protocol.verdict.compare import compare
from protocol.verdict.curves import read_curve
from protocol.verdict.gather import gather
from tests.protocol.fake_trainer import FAKE_CODE, FAKE_TORCH

STEPS = 20
PLAN = """
[plan]
name = "noise"
config = "debug_model.toml"
output = "{output}"
steps = {steps}
local_batch_size = 4
dp_degree = 1
[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"metrics.log_freq" = 1
"validation.enable" = true
"validation.freq" = 10

[tolerance]
mode = "{mode}"

[criterion]
metric = "validation/loss"
{bound}

[[sets]]
name = "near"
kind = "technique"
overrides = {{ "optimizer.lr" = 1e-3 }}

[[sets]]
name = "far"
kind = "technique"
overrides = {{ "optimizer.lr" = 2e-3 }}
"""
# The control family's validation losses at the last step: mean 4.0, sample SD sqrt(2.5e-6), so
# sigma = sqrt(2.5e-6) x sqrt(1 + 1/5) = 0.0017321 with the control and its 4 noise controls.
FAMILY = {"control": 4.0, "control-noise1": 4.002, "control-noise2": 3.999, "control-noise3": 4.001,
          "control-noise4": 3.998}
SETS = {"near": 4.003, "far": 4.02}
SIGMA = statistics.stdev(FAMILY.values()) * math.sqrt(1 + 1 / 5)


@pytest.fixture(autouse=True)
def software(monkeypatch):
    """What a run started now would record: fixed, so that no trainer file is hashed here."""
    monkeypatch.setattr(protocol.run.reuse, "current", lambda: Now(code=FAKE_CODE, torch=FAKE_TORCH))


def write_plan(tmp_path: Path, bound: str, mode: str = "statistical") -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(output=tmp_path / "out", steps=STEPS, mode=mode, bound=bound))
    return path


def write_run(folder: Path, validation: float, seed: int) -> None:
    """metrics.jsonl of a run: a training loss falling from 5 with noise of 0.002 nats a step (its
    own, by seed), and the validation loss at steps 10 and 20 (`validation` at the last)."""
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(1, STEPS + 1):
        lines.append({"step": step, "loss": 5 - 0.05 * step + rng.normal(0, 0.002),
                      "grad_norm": 1 + rng.normal(0, 0.01), "lr": 1e-3})
        if step % 10 == 0:
            lines.append({"step": step, "kind": "validation", "validation/loss": validation + (STEPS - step) * 0.01})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_runs(plan, values: dict[str, float]) -> None:
    outputs = {launch.name: launch.output for launch in plan.launches()}
    for seed, (name, value) in enumerate(values.items()):
        write_run(outputs[name], value, seed)


def judged(plan):
    """The comparison of the plan's run folders, judged by its criterion (as `protocol compare`)."""
    found = gather(plan, [], lambda path, name: read_curve(path, name))
    comparison = compare(found.controls, found.tests, plan.tolerance, expect=found.expect,
                         not_compared=found.not_compared)
    return judge_by_criterion(plan, comparison).comparison


# ---------------------------------------------------------------------------------------------
# The bound in noise SDs


def test_the_bound_is_the_controls_value_plus_k_sigma_of_the_family(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max_sigmas_above_control = 3"))
    assert plan.criterion.in_sigmas and plan.criterion.relative
    assert plan.criterion.describe() == "validation/loss at step 20 <= control + 3 sigma"
    write_runs(plan, {**FAMILY, **SETS})
    noise = family_noise(plan)
    assert noise.sigma == pytest.approx(0.0017320508)
    assert noise.values == pytest.approx(FAMILY)
    control, judgements = judge_plan(plan)
    assert control.value == 4.0
    assert threshold(plan, control).value == pytest.approx(4.0 + 3 * SIGMA)
    assert judgements["near"].meets is True and judgements["far"].meets is False
    assert judgements["far"].describe(plan.criterion) == \
        "validation/loss at step 20 = 4.02 > 4.0052: misses the criterion"
    assert plan.criterion.describe(4.0, noise.sigma) == \
        "validation/loss at step 20 <= control + 3 sigma (4 + 3 x 0.00173 -> 4.0052)"


def test_without_enough_family_values_no_set_is_judged_and_the_reason_says_why(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max_sigmas_above_control = 3"))
    write_runs(plan, {"control": 4.0, "control-noise1": 4.002, **SETS})  # three noise controls never ran
    control, judgements = judge_plan(plan)
    assert judgements["near"].meets is None
    assert judgements["near"].describe(plan.criterion).startswith(
        "not judged: sigma needs at least 3 of the control family's runs with a value of validation/loss at step "
        "20, 2 have one (control-noise2: no validation/loss at step 20 (no validation logged); ")


def test_a_family_that_measured_no_noise_gives_no_sigma(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max_sigmas_above_control = 3"))
    outputs = {launch.name: launch.output for launch in plan.launches()}
    for name in FAMILY:
        write_run(outputs[name], 4.0, 0)
    assert family_noise(plan).missing == ("the control family's 5 runs have the same value of validation/loss at "
                                          "step 20: they measure no noise")


# ---------------------------------------------------------------------------------------------
# Reading the key


def test_a_bound_in_noise_sds_without_noise_controls_is_refused_with_one_error(tmp_path):
    with pytest.raises(PlanError) as info:
        load_plan(write_plan(tmp_path, "max_sigmas_above_control = 3", mode="exact"))
    assert str(info.value).endswith(
        ": 1 problem:\n  - criterion.max_sigmas_above_control: sigma is measured from the control's noise controls, "
        "which only [tolerance] mode = \"statistical\" runs (this plan's mode is 'exact'); set mode = \"statistical\" "
        "(noise_controls >= 2), or give max_vs_control or max instead")


@pytest.mark.parametrize("bound, message", [
    ("max_sigmas_above_control = 3\nmax_vs_control = 1.02",
     "criterion: give one bound, not max_vs_control and max_sigmas_above_control: max (an absolute bound"),
    ("max_sigmas_above_control = 0", "criterion.max_sigmas_above_control: noise SDs above the control's value, must "
                                     "be > 0, got 0.0"),
    ("max_sigmas_above_contrl = 3", "criterion.max_sigmas_above_contrl: unknown key; did you mean "
                                    "'max_sigmas_above_control'?"),
    ("", "criterion.max: missing: give max = 3.35 (metric <= 3.35), max_vs_control = 1.02 (metric <= 1.02 x the "
         "control's value) or max_sigmas_above_control = 3"),
])
def test_bound_mistakes_name_the_key(tmp_path, bound, message):
    with pytest.raises(PlanError) as info:
        load_plan(write_plan(tmp_path, bound))
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------
# The margin beside every criterion, and the warning of a loose one


def test_a_loose_criterion_states_its_margin_in_nats_sigmas_and_detectable_offsets_and_warns(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max_vs_control = 1.05"))
    write_runs(plan, {**FAMILY, **SETS})
    comparison = judged(plan)
    mde = next(n.mde for n in comparison.noise if n.observable == "loss")
    short = "criterion: validation/loss at step 20 <= 1.05 x control (4 -> 4.2)"
    assert comparison.criterion == (f"{short} [margin +0.2 nats above the control: {0.2 / SIGMA:.3g} noise SDs of "
                                    "the measure (sigma 0.00173 nats from the control family's 5 runs), "
                                    f"{0.2 / mde:.3g} x the detectable loss offset ({mde:.3g} nats)]")
    assert comparison.status_text == f"PASS: {short}; every test set meets it"  # the verdict line stays short
    assert 0.2 > 10 * mde
    loose = [w for w in comparison.warnings if w.startswith("the criterion ")]
    assert loose == [f"the criterion validation/loss at step 20 <= 1.05 x control (4 -> 4.2) allows 0.2 nats above "
                     f"the control, {0.2 / mde:.3g} times the plan's detectable loss offset ({mde:.3g} nats): it "
                     "approves sets the noise controls show to be far from the control; a bound in noise units "
                     "(max_sigmas_above_control) is as tight as the plan can measure"]


def test_a_tight_criterion_in_noise_sds_states_its_margin_and_does_not_warn(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max_sigmas_above_control = 3"))
    write_runs(plan, {**FAMILY, **SETS})
    comparison = judged(plan)
    mde = next(n.mde for n in comparison.noise if n.observable == "loss")
    assert comparison.criterion.endswith(f"(4 + 3 x 0.00173 -> 4.0052) [margin +{3 * SIGMA:.3g} nats above the "
                                         f"control: 3 noise SDs of the measure (sigma 0.00173 nats from the "
                                         f"control family's 5 runs), "
                                         f"{3 * SIGMA / mde:.3g} x the detectable loss offset ({mde:.3g} nats)]")
    assert not [w for w in comparison.warnings if w.startswith("the criterion ")]
    assert [r.outcome for r in comparison.results] == ["PASS", "FAIL"]
    assert comparison.status_text.startswith("FAIL: far (criterion: validation/loss at step 20 <= control + 3 sigma")


def test_in_exact_mode_the_margin_says_no_noise_was_measured_and_how_to_measure_it(tmp_path):
    plan = load_plan(write_plan(tmp_path, "max = 4.1", mode="exact"))
    write_runs(plan, {"control": 4.0, **SETS})
    comparison = judged(plan)
    assert comparison.criterion == (
        "criterion: validation/loss at step 20 <= 4.1 [margin +0.1 nats above the control; no noise measured: the "
        "plan has no noise controls (exact mode); run them with [tolerance] mode = \"statistical\"]")
    assert not [w for w in comparison.warnings if w.startswith("the criterion ")]


def test_the_report_and_the_terminal_show_the_margin_and_the_warning(tmp_path, capsys):
    from protocol.cli import main

    path = write_plan(tmp_path, "max_vs_control = 1.05")
    write_runs(load_plan(path), {**FAMILY, **SETS})
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: the criterion validation/loss at step 20 <= 1.05 x control (4 -> 4.2) allows 0.2 nats" in out
    assert out.splitlines()[-1] == "PASS: criterion: validation/loss at step 20 <= 1.05 x control (4 -> 4.2); every " \
                                   "test set meets it"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Criterion\n\ncriterion: validation/loss at step 20 <= 1.05 x control (4 -> 4.2) [margin +0.2 nats " \
           "above the control: 115 noise SDs of the measure (sigma 0.00173 nats from the control family's 5 " \
           "runs)" in report
