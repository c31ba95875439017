"""report.md, report.json, the plots and the console table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from protocol.plan.tolerance import Tolerance
from protocol.report.as_json import comparison_from_dict
from protocol.report.formats import fmt_diff, fmt_loss
from protocol.report.markdown import format_table, write_report
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve

STEPS = list(range(1, 31))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def curve(name, offset=0.0, jump_at=None, jump=0.0):
    loss = [5.0 - 0.01 * s + offset + (jump if jump_at is not None and s >= jump_at else 0.0) for s in STEPS]
    return Curve(name=name, steps=STEPS, loss=loss, grad_norm=[1.0 + 0.1 * s for s in STEPS], source=f"<{name}>")


@pytest.fixture
def exact_case():
    control = curve("fsdp")
    tests = [curve("tp2", offset=2.4e-7), curve("pp2", jump_at=7, jump=1e-3)]
    comparison = compare(control, tests, Tolerance(mode="exact", loss_atol=1e-4))
    return comparison, [control], tests


def table_rows(markdown_text):
    """Rows of the first markdown table, as lists of cells (header and separator dropped)."""
    lines = markdown_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| set | layout |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_number_formats_keep_small_diffs_readable():
    assert fmt_diff(2.4e-07) == "2.40e-07"
    assert fmt_diff(-3e-5, signed=True) == "-3.00e-05"
    assert fmt_diff(1e-3, signed=True) == "+1.00e-03"
    assert fmt_diff(0.0) == "0" and fmt_diff(None) == "-" and fmt_diff(math.inf) == "inf"
    assert fmt_loss(4.99000024) == "4.99" and fmt_loss(10.1234567) == "10.1235"


def test_write_report_exact(tmp_path, exact_case):
    comparison, controls, tests = exact_case
    paths = write_report(comparison, controls, tests, tmp_path / "out", layouts={"tp2": "dp 2 tp 2", "pp2": "pp 2"})
    assert set(paths) == {"markdown", "json", "loss", "grad_norm"}  # no learning rate logged: no lr.png
    for path in paths.values():
        assert path.is_file() and path.parent == tmp_path / "out"

    text = paths["markdown"].read_text(encoding="utf-8")
    assert text.startswith("# Convergence report: exact mode")
    assert "loss_atol 0.0001" in text
    rows = table_rows(text)
    assert len(rows) == 2
    tp2, pp2 = rows
    assert tp2 == ["tp2", "dp 2 tp 2", "4.99", "4.7", "2.40e-07", "2.40e-07", "+2.40e-07", "PASS"]
    assert pp2[:2] == ["pp2", "pp 2"] and pp2[-1] == "FAIL"
    assert pp2[4] == "1.00e-03" and pp2[6] == "+1.00e-03"
    assert pp2[5] == fmt_diff(24 / 30 * 1e-3)
    # the failure line names the reason and the first diverging step
    failure = next(line for line in text.splitlines() if line.startswith("- **pp2**"))
    assert "step 7" in failure and failure.endswith(": 7)")
    assert "**Overall: FAIL** (1/2 sets as expected)" in text
    assert text.splitlines()[2] == "**FAIL: pp2**"


def test_report_json_round_trip(tmp_path, exact_case):
    comparison, controls, tests = exact_case
    paths = write_report(comparison, controls, tests, tmp_path, layouts={"tp2": "dp 2 tp 2"})
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert data["mode"] == "exact" and data["passed"] is False and data["control"] == "fsdp"
    assert data["tolerance"]["loss_atol"] == 1e-4
    assert data["layouts"] == {"tp2": "dp 2 tp 2", "pp2": ""}
    by_name = {r["name"]: r for r in data["results"]}
    assert by_name["pp2"]["first_diverging_step"] == 7 and by_name["pp2"]["failed"] is True
    assert by_name["pp2"]["outcome"] == "FAIL" and data["status"] == "FAIL" and data["status_line"] == "FAIL: pp2"
    assert by_name["tp2"]["max_abs_diff"] == pytest.approx(2.4e-7, rel=1e-6)
    assert by_name["tp2"]["steps"] == STEPS and len(by_name["tp2"]["loss_diff"]) == 30
    assert comparison_from_dict(data) == comparison


def test_report_json_is_strict_with_non_finite_numbers(tmp_path):
    control = curve("fsdp")
    diverged = curve("nan")
    diverged.loss[10] = math.nan
    comparison = compare(control, [diverged], Tolerance(mode="exact"))
    paths = write_report(comparison, [control], [diverged], tmp_path)

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(paths["json"].read_text(encoding="utf-8"), parse_constant=no_constants)
    assert data["results"][0]["max_abs_diff"] == "nan"
    back = comparison_from_dict(data).results[0]
    assert math.isnan(back.max_abs_diff) and math.isnan(back.loss_diff[10])
    assert back.first_diverging_step == 11


def test_pngs_are_valid(tmp_path, exact_case):
    comparison, controls, tests = exact_case
    paths = write_report(comparison, controls, tests, tmp_path)
    for key in ("loss", "grad_norm"):
        data = paths[key].read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 600 and height >= 400


def noisy(rng, name, offset=0.0, norm_factor=1.0):
    """A 300-step run: the common trajectory plus its own autocorrelated noise, lr and timings."""
    steps = list(range(1, 301))
    noise = np.cumsum(rng.normal(0, 1e-4, 300)) * 0.2 + rng.normal(0, 3e-4, 300)
    loss = [5.0 * math.exp(-s / 80) + 2.0 + n + offset for s, n in zip(steps, noise)]
    norm = [(0.5 + 0.001 * s) * norm_factor * (1 + n) for s, n in zip(steps, rng.normal(0, 1e-3, 300))]
    extra = {"lr": [1e-3] * 300, "step_time_s": [0.05] * 300, "tokens_per_s": [4000.0] * 300,
             "peak_memory_gib": [0.5] * 300}
    return Curve(name=name, steps=steps, loss=loss, grad_norm=norm, source=f"<{name}>", extra=extra)


def test_statistical_report(tmp_path):
    rng = np.random.default_rng(0)
    family = [noisy(rng, "control")] + [noisy(rng, f"control-noise{k}") for k in range(1, 5)]
    tests = [noisy(rng, "tp2"), noisy(rng, "norm bug", norm_factor=1.05), noisy(rng, "lr x1.05", offset=-0.01)]
    comparison = compare(family, tests, Tolerance(mode="statistical"), expect={"lr x1.05": "fail"})
    paths = write_report(comparison, family, tests, tmp_path, layouts={"tp2": "dp_shard 2, tp 2"})
    text = paths["markdown"].read_text(encoding="utf-8")
    assert text.startswith("# Convergence report: statistical mode, paired\n\n**FAIL: norm bug**")
    assert "noise controls: control-noise1, control-noise2, control-noise3, control-noise4" in text
    rows = table_rows(text)
    assert [(row[0], row[2], row[-1]) for row in rows] == [
        ("tp2", "pass", "PASS"), ("norm bug", "pass", "FAIL"), ("lr x1.05", "fail", "FAIL (expected)")]
    assert rows[1][4].endswith("fails") and not rows[1][3].endswith("fails")  # the norm, not the loss
    # what the plan can detect, each observable with its noise, margin and detectable offset (alone and once
    # every set of the plan is counted)
    detect = text[text.index("## What this plan can detect"):text.index("## Verdicts")]
    noise = {n.observable: n for n in comparison.noise}
    assert f"| loss | nats | {fmt_diff(noise['loss'].noise_sd)} | {fmt_diff(noise['loss'].margin)} | " \
           f"{fmt_diff(noise['loss'].mde)} ({fmt_diff(noise['loss'].mde_if_noisier)}) | " \
           f"{fmt_diff(noise['loss'].plan_mde)} | <= 4.6% |" in detect
    assert noise["loss"].plan_mde > noise["loss"].mde
    assert "False fails: were every set correct, this plan would fail by chance with probability at most" in detect
    # the verdict table brackets the bound applied to each set, not the margin
    norm = comparison.results[1].observables[1]
    assert rows[1][4] == f"{fmt_diff(norm.diff, signed=True)} ({fmt_diff(norm.bound)}) fails"
    # with 4 noise controls the noise SD may be up to 2.37 times its estimate (95%)
    assert noise["loss"].mde_if_noisier > noise["loss"].mde
    assert "TOST p" in text and "## Performance" in text and "| tp2 | 0.0500 | 4000 | 0.500 |" in text
    assert "- **norm bug**: grad_norm: final-window" in text and "(first diverging step: " in text
    assert "- **tp2**" not in text  # a passing set has no failure line and no first diverging step
    assert comparison_from_dict(json.loads(paths["json"].read_text())) == comparison
    for key in ("loss", "grad_norm", "lr"):
        assert paths[key].read_bytes()[:8] == PNG_SIGNATURE


def test_format_table_for_the_console(exact_case):
    comparison, _, _ = exact_case
    lines = format_table(comparison, layouts={"tp2": "dp 2 tp 2"}).splitlines()
    assert len(lines) == 4  # header, rule, one line per set
    assert lines[0].split() == ["set", "layout", "initial", "final", "max", "abs", "diff", "mean", "abs", "diff",
                                "final", "diff", "verdict"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["tp2", "dp", "2", "tp", "2", "4.99", "4.7", "2.40e-07", "2.40e-07", "+2.40e-07",
                                "PASS"]
    assert lines[3].split()[0] == "pp2" and lines[3].split()[-1] == "FAIL"
    # columns line up: every verdict starts at the same offset
    assert len({line.rfind("PASS") if "PASS" in line else line.rfind("FAIL") for line in lines[2:]}) == 1


def test_runs_without_a_curve_are_failed_rows_and_fail_the_report(tmp_path):
    from protocol.verdict.results import NotCompared

    control = curve("fsdp")
    missing = [NotCompared("cp2", "FAILED", "exit 2"), NotCompared("pp2", "NOT RUN", "needs seed")]
    comparison = compare(control, [curve("tp2")], Tolerance(mode="exact"), not_compared=missing)
    assert comparison.passed is False and comparison.results[0].verdict is True
    paths = write_report(comparison, [control], [curve("tp2")], tmp_path, layouts={"cp2": "dp_shard 2, cp 2"})
    text = paths["markdown"].read_text()
    assert table_rows(text)[1:] == [["cp2", "dp_shard 2, cp 2", "-", "-", "-", "-", "-", "FAILED"],
                                    ["pp2", "", "-", "-", "-", "-", "-", "NOT RUN"]]
    assert "- **cp2**: FAILED: exit 2" in text and "**Overall: FAIL** (1/3 sets as expected)" in text
    data = json.loads(paths["json"].read_text())
    assert data["layouts"] == {"tp2": "", "cp2": "dp_shard 2, cp 2", "pp2": ""}
    assert comparison_from_dict(data) == comparison
    lines = format_table(comparison).splitlines()
    assert lines[3].split() == ["cp2", "-", "-", "-", "-", "-", "FAILED"]
