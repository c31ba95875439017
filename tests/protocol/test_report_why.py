"""A statistical report that shows why each set passed or failed: the bound applied to each set and
observable with its p-value and Holm threshold (report.md, report.json), the plan's false-fail and
detectable-offset figures, the findings that fail nothing (sets leaning the same way, a noisier
set, float16 skips, learning rates equal up to rounding), a caveat on timings of runs that shared a
machine, and difference panels scaled to what is judged."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from protocol.report.as_json import comparison_from_dict
from protocol.report.findings import LR_ROUNDING, timing_caveat
from protocol.report.formats import fmt_diff, fmt_share
from protocol.report.markdown import markdown, performance, write_report
from protocol.report.plot_verdicts import HEADROOM, judged_ylim, noise_band, smooth
from protocol.verdict.compare import compare
from protocol.verdict.family_wise import set_false_fail
from tests.protocol.test_decision import TOL, family, run
from tests.protocol.test_family_wise import noisy_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
POSITIVE = {"wd x1.02": "fail", "lr x1.05": "fail"}


def with_extras(curve, lr=1e-3, step_time=0.05):
    n = len(curve.steps)
    curve.extra = {"lr": [lr] * n, "step_time_s": [step_time] * n, "tokens_per_s": [2048 / step_time] * n,
                   "peak_memory_gib": [0.5] * n}
    return curve


@pytest.fixture(scope="module")
def plan():
    """Two correct layouts whose gradient norms both sit 0.08% high (a lean, within their bounds), a
    positive control 3e-3 nats off (about 10 noise SDs: it fails), and one 0.014 nats off (about
    47: far off the scale). The family's learning rates differ by a few units of the last place
    (a mean of them is not bitwise any of them); its runs' step times differ 2.2x; a noise control
    and a set skipped float16 steps."""
    rng = np.random.default_rng(0)
    controls = family(rng)
    tests = [run(rng, "tp2", norm_factor=math.exp(8e-4)), run(rng, "pp2", norm_factor=math.exp(8e-4)),
             run(rng, "wd x1.02", loss_offset=3e-3), run(rng, "lr x1.05", loss_offset=-0.014)]
    for k, member in enumerate(controls):
        with_extras(member, lr=1e-3 * (1 + k * 2.2e-16), step_time=0.11 if k == 3 else 0.05)
    for test in tests:
        with_extras(test, lr=1.05e-3 if test.name == "lr x1.05" else 1e-3)
    controls[2].skipped, tests[0].skipped = [40, 41], [120]
    return compare(controls, tests, TOL, expect=POSITIVE), controls, tests


@pytest.fixture(scope="module")
def written(plan, tmp_path_factory):
    """The plan's report, written once (drawing its figures is most of these tests' time)."""
    comparison, controls, tests = plan
    return write_report(comparison, controls, tests, tmp_path_factory.mktemp("report"))


def verdict(comparison, name, observable):
    result = next(r for r in comparison.results if r.name == name)
    return next(o for o in result.observables if o.observable == observable)


def section(text, title):
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_report_states_the_bound_each_set_was_held_to(plan, written):
    comparison, _, _ = plan
    assert comparison.status == "PASS"
    paths = written
    text = paths["markdown"].read_text(encoding="utf-8")
    why = section(text, "## Why each set passed or failed")
    wd = verdict(comparison, "wd x1.02", "loss")
    assert not wd.passed and abs(wd.diff) >= wd.bound > 0
    # bound in nats and in noise SDs, |D| in noise SDs, the p-value and its Holm threshold
    assert (f"| wd x1.02 | loss | {fmt_diff(wd.diff, signed=True)} | {fmt_diff(wd.noise_sd)} | "
            f"{abs(wd.diff) / wd.noise_sd:.1f} | {fmt_diff(wd.bound)} | {wd.bound / wd.noise_sd:.1f} | "
            f"{wd.p_value:.2g} | {wd.holm_threshold:.2g} | {wd.noise_ratio:.2f} | fail: \\|diff\\| >= bound |") in why
    tp2 = verdict(comparison, "tp2", "grad_norm")
    assert tp2.passed and f"| tp2 | grad_norm | {fmt_diff(tp2.diff, signed=True)} |" in why
    assert why.count("| pass |") == 6 and why.count("| fail: ") == 2  # lr x1.05's norm is within its bound
    # the verdict table brackets the bound, which is not the margin
    assert f"{fmt_diff(wd.diff, signed=True)} ({fmt_diff(wd.bound)}) fails" in text and wd.bound != wd.margin
    # the plan's false-fail bound and each correct set's own; the plan-level detectable offset
    detect = section(text, "## What this plan can detect")
    own = {r.name: set_false_fail(r.observables) for r in comparison.results}
    assert (f"probability at most {fmt_share(comparison.plan_false_fail)} (Holm's step-down over its 8 judged "
            f"observables at the plan's level 0.05") in detect
    assert f"each correct set on its own: tp2 <= {fmt_share(own['tp2'])}, pp2 <= {fmt_share(own['pp2'])}." in detect
    loss = comparison.noise[0]
    assert f"| {fmt_diff(loss.mde)} ({fmt_diff(loss.mde_if_noisier)}) | {fmt_diff(loss.plan_mde)} |" in detect
    for key in ("loss", "grad_norm", "lr"):
        assert paths[key].read_bytes()[:8] == PNG_SIGNATURE and paths[key].stat().st_size > 20_000


def test_findings_lean_skips_learning_rates_and_timings(plan):
    comparison, controls, tests = plan
    text = markdown(comparison, figures=performance([*controls, *tests]))
    findings = section(text, "## Findings")
    # both layouts' gradient norms sit above the family's mean, together beyond 1 noise SD
    tp2, pp2 = verdict(comparison, "tp2", "grad_norm"), verdict(comparison, "pp2", "grad_norm")
    sd = comparison.noise[1].noise_sd
    mean = (tp2.diff + pp2.diff) / 2
    assert tp2.diff > 0 and pp2.diff > 0 and mean > sd
    assert (f"- correct sets lean the same way in grad_norm: tp2 {fmt_diff(tp2.diff, signed=True)} "
            f"({tp2.diff / sd:+.1f} noise SD), pp2 {fmt_diff(pp2.diff, signed=True)} ({pp2.diff / sd:+.1f} noise SD); "
            f"their mean {fmt_diff(mean, signed=True)} is {mean / sd:.1f} noise SDs above the control family's. "
            "Not a failure") in findings
    assert ("- float16 steps skipped for an overflow (left out of every comparison): control 0, control-noise1 0, "
            "control-noise2 2, control-noise3 0, control-noise4 0, tp2 1, pp2 0, wd x1.02 0, lr x1.05 0.") in findings
    # a mean of learning rates equal up to the last place differs from each by ~1e-16: not a finding
    tp2_lr = comparison.results[0].lr_max_rel_diff
    assert 0 < tp2_lr < LR_ROUNDING
    assert ("- learning rate differs from the control family's (largest relative difference): lr x1.05 5.00e-02; "
            "the other sets' equal it within float rounding.") in findings
    assert "Learning-rate differences (largest relative; equal: below float rounding): tp2 equal, pp2 equal" in text
    assert "noisier than its controls" not in findings
    timings = section(text, "## Performance")
    assert ("Caveat: the control family's runs are identical, yet differ in step time 2.2x (0.05-0.11 s) and "
            "tokens/s 2.2x (1.862e+04-4.096e+04): the runs shared a machine") in timings


def test_a_noisier_set_is_named_with_its_ratio():
    rng = np.random.default_rng(1)
    comparison = compare(family(rng), [run(rng, "tp2"), noisy_run(rng, "cp2", 3.0)], TOL)
    loss = verdict(comparison, "cp2", "loss")
    assert loss.noise_ratio >= 1.5 and verdict(comparison, "tp2", "loss").noise_ratio < 1.5
    assert verdict(comparison, "cp2", "grad_norm").noise_ratio < 1.5  # its norm's noise: not named
    text = markdown(comparison)
    findings = section(text, "## Findings")
    assert (f"- cp2 is noisier than its controls: its own noise raised its loss noise SD {loss.noise_ratio:.2f}x, to "
            f"{fmt_diff(loss.noise_sd)} from the family's {fmt_diff(loss.family_noise_sd)}; it was judged by the "
            "larger, so it detects less.") in findings
    assert "its grad_norm" not in findings
    why = section(text, "## Why each set passed or failed")
    assert f"| {loss.noise_ratio:.2f} (noisier) |" in why and why.count("(noisier)") == 1
    assert "float16 steps skipped" not in text and "learning rate differs" not in text


def test_report_json_has_the_new_numbers(plan, written):
    comparison, _, _ = plan
    data = json.loads(written["json"].read_text(encoding="utf-8"))
    wd = verdict(comparison, "wd x1.02", "loss")
    item = next(r for r in data["results"] if r["name"] == "wd x1.02")
    loss = item["observables"][0]
    for key in ("bound", "p_value", "holm_threshold", "noise_ratio", "family_noise_sd", "chance_fail"):
        assert loss[key] == pytest.approx(getattr(wd, key))
    assert loss["bound_sigmas"] == pytest.approx(wd.bound / wd.noise_sd)
    assert loss["diff_sigmas"] == pytest.approx(abs(wd.diff) / wd.noise_sd)
    assert item["set_false_fail"] == pytest.approx(set_false_fail(comparison.results[2].observables))
    assert data["plan_false_fail"] == pytest.approx(comparison.plan_false_fail)
    assert [n["plan_mde"] for n in data["noise"]] == pytest.approx([n.plan_mde for n in comparison.noise])
    assert data["family_skips"]["control-noise2"] == 2 and data["results"][0]["skipped_steps"] == 1
    findings = data["findings"]
    assert [lean["observable"] for lean in findings["leans"]] == ["loss", "grad_norm"]
    assert findings["leans"][1]["sigmas"] > 1 and findings["lr_differs"] == {"lr x1.05": pytest.approx(0.05)}
    assert findings["skips"]["tp2"] == 1 and findings["noisier"] == []
    assert findings["timing_caveat"].startswith("the control family's runs are identical")
    assert comparison_from_dict(data) == comparison


def test_the_difference_panels_are_scaled_to_what_is_judged(plan):
    # the largest bound and every near set's |D| + SD, with headroom; a set beyond 3x the largest bound is off
    limit, off = judged_ylim([3e-4, 3.2e-4, 3.1e-4], [1e-5, 4.5e-4, -1.4e-2], [1e-4, 1e-4, 1e-4])
    assert limit == pytest.approx(HEADROOM * 5.5e-4) and off == [2]
    assert judged_ylim([3e-4], [2e-4], [1e-4], also=[9e-4]) == (pytest.approx(HEADROOM * 9e-4), [])
    assert judged_ylim([math.nan], [2e-3], [1e-3]) == (pytest.approx(HEADROOM * 3e-3), [])
    comparison, _, _ = plan
    judged = [o for r in comparison.results for o in r.observables if o.observable == "loss"]
    limit, off = judged_ylim([o.bound for o in judged], [o.diff for o in judged], [o.noise_sd for o in judged])
    names = [r.name for r in comparison.results]
    assert [names[i] for i in off] == ["lr x1.05"]  # 47 noise SDs: an arrow, not the scale
    wd = verdict(comparison, "wd x1.02", "loss")
    assert abs(wd.diff) + wd.noise_sd < limit < 4 * wd.bound  # the failing one shows, outside its bound


def test_the_noise_band_is_a_members_spread():
    rng = np.random.default_rng(2)
    rows = rng.normal(0.0, 1e-3, (5, 400))
    band = noise_band(rows)
    # a run's noise smoothed over 11 steps has SD 1e-3 / sqrt(11); one more member's difference from the
    # mean of 5 has sqrt(1 + 1/5) times that
    assert np.median(band) == pytest.approx(1e-3 / math.sqrt(11) * math.sqrt(1.2), rel=0.15)
    gappy = np.array([1.0, np.nan, 3.0, 5.0])
    assert np.isnan(smooth(gappy, 1)[1]) and smooth(gappy, 1)[2] == pytest.approx(4.0)


def test_timings_of_identical_runs_that_agree_carry_no_caveat():
    figures = {"c": {"step_time_s": 0.05, "tokens_per_s": 4000.0}, "n1": {"step_time_s": 0.07, "tokens_per_s": None}}
    assert timing_caveat(figures, ["c", "n1"]) is None
    figures["n1"]["step_time_s"] = 0.08
    assert timing_caveat(figures, ["c", "n1"]).startswith("the control family's runs are identical, yet differ in "
                                                          "step time 1.6x (0.05-0.08 s):")
    assert timing_caveat(figures, ["c"]) is None  # one run has nothing to differ from
