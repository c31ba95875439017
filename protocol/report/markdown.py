"""The verdict written out for a skeptical reader: report.md, report.json and one PNG per figure.

report.md, from top to bottom: the verdict and why; the control family, the code, the
environment and the seed checkpoint every run started from (from each run's own record); the
decision rule and what this plan could detect, with its false-fail bounds; one row per set
(layout, expectation, each judged observable); statistical mode: why each set passed or failed
(the bound applied to it, its p-value against its Holm threshold) and the findings that fail
nothing (protocol.report.statistical, protocol.report.findings); the details of both tests per
observable; each failure's reason; per run step time, tokens/s and peak memory (evidence that a
technique was really on; a caveat when identical runs differ); every option in which a set's
configuration differs from the control's; every run's command, software and device. report.json
holds the same numbers (protocol.report.as_json); the PNGs are protocol.report.plots's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from protocol.report.as_json import comparison_to_dict, encode, report_extras
from protocol.report.findings import findings as find, markdown as findings_markdown, timing_caveat
from protocol.report.formats import fmt_diff, fmt_loss, markdown_table as _markdown_table
from protocol.report.plots import write_plots
from protocol.report.statistical import bound_or_margin, details_section, detectable_section, why_section
from protocol.report.where import where_section, write_fingerprint_maps
from protocol.verdict.curves import Curve
from protocol.verdict.decision import ObservableVerdict
from protocol.verdict.results import FAIL, INCONCLUSIVE, Comparison, SetResult
from protocol.verdict.run_info import RunInfo, code_summary

logger = logging.getLogger(__name__)

EXACT_COLUMNS = ("set", "layout", "initial", "final", "max abs diff", "mean abs diff", "final diff", "verdict")
STATISTICAL_COLUMNS = ("set", "layout", "expect", "loss: window diff (bound)", "grad norm: window diff (bound)",
                       "verdict")


# ---------------------------------------------------------------- the verdict line
def status_line(comparison: Comparison) -> str:
    """PASS / FAIL / INCONCLUSIVE with the sets that decided it (a [criterion]'s own line when it
    judged the sets)."""
    if comparison.status_text:
        return comparison.status_text
    failing = [r.name for r in comparison.results if r.failed and r.expect == "pass"]
    failing += [m.name for m in comparison.not_compared]
    if comparison.status == FAIL:
        return f"FAIL: {', '.join(failing)}" if failing else f"FAIL: {comparison.note}"
    if comparison.status == INCONCLUSIVE:
        passed = [r.name for r in comparison.results if not r.failed and r.expect == "fail"]
        return (f"INCONCLUSIVE: positive control {', '.join(passed)} passed, so this plan could not have caught a bug "
                "of that size (more noise controls, more steps, or a narrower margin)")
    caught = [r.name for r in comparison.results if r.expect == "fail"]
    extra = f"; positive control{'s' if len(caught) > 1 else ''} {', '.join(caught)} caught" if caught else ""
    return f"PASS: every test set trains like the control{extra}"


# ---------------------------------------------------------------- tables
def _observable(result: SetResult, name: str) -> ObservableVerdict | None:
    return next((o for o in result.observables if o.observable == name), None)


def _observable_cell(result: SetResult, name: str) -> str:
    verdict = _observable(result, name)
    if verdict is None:
        return "-"
    mark = "" if verdict.passed else (" drifts" if verdict.equivalent else " fails")
    return f"{fmt_diff(verdict.diff, signed=True)} ({fmt_diff(bound_or_margin(verdict))}){mark}"


def _rows(comparison: Comparison, layouts: dict[str, str] | None) -> list[list[str]]:
    """One row per judged set, then one per run that has no curve (FAILED / NOT RUN)."""
    layouts = layouts or {}
    if comparison.mode == "exact":
        rows = [[r.name, layouts.get(r.name, ""), fmt_loss(r.initial_loss), fmt_loss(r.final_loss),
                 fmt_diff(r.max_abs_diff), fmt_diff(r.mean_abs_diff), fmt_diff(r.final_diff, signed=True), r.outcome]
                for r in comparison.results]
        blank = ["-"] * 5
    else:
        rows = [[r.name, layouts.get(r.name, ""), r.expect, _observable_cell(r, "loss"),
                 _observable_cell(r, "grad_norm"), r.outcome] for r in comparison.results]
        blank = ["-"] * 3
    rows += [[m.name, layouts.get(m.name, ""), *blank, m.verdict] for m in comparison.not_compared]
    return rows


def columns(comparison: Comparison) -> tuple[str, ...]:
    return EXACT_COLUMNS if comparison.mode == "exact" else STATISTICAL_COLUMNS


def format_table(comparison: Comparison, layouts: dict[str, str] | None = None) -> str:
    """The summary table as aligned plain text for a terminal."""
    rows = [list(columns(comparison))] + _rows(comparison, layouts)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- sections
def _head(comparison: Comparison, runs: list[RunInfo]) -> list[str]:
    design = {"paired": ", paired", "unpaired": ", UNPAIRED"}.get(comparison.design, "")
    lines = [f"# Convergence report: {comparison.mode} mode{design}", "", f"**{status_line(comparison)}**", ""]
    lines += [_control_line(comparison), ""]
    if comparison.design == "unpaired":
        lines += ["UNPAIRED (--unpaired): the sets are judged against the spread of control repeats that may differ in "
                  "data and initial weights, so the noise below may hold the data's variation too, and only effects "
                  "larger than it can be detected; plans pair every run on the same data.", ""]
    for label, text in (("Code", code_summary(runs)), ("Environment", _shared(runs, _environment)),
                        ("Started from", _shared(runs, lambda r: r.start))):
        if text:
            lines += [f"{label}: {text}", ""]
    lines += [f"Decision: {_rule_line(comparison)}", ""]
    lines += [f"Warning: {w}" for w in comparison.warnings] + ([""] if comparison.warnings else [])
    return lines


def _environment(run: RunInfo) -> str | None:
    if run.torch is None and run.device is None:
        return None
    cuda = f", CUDA {run.cuda}, NCCL {run.nccl}" if run.cuda else ""
    return f"torch {run.torch}, Python {run.python}, {run.device}{cuda}; {run.numerics}"


def _shared(runs: list[RunInfo], describe) -> str | None:
    """'X (every run)' or 'X (a, b); Y (c)'; None when no run says."""
    groups: dict[str, list[str]] = {}
    for run in runs:
        groups.setdefault(describe(run) or "not recorded", []).append(run.name)
    if not groups or set(groups) == {"not recorded"}:
        return None
    if len(groups) == 1:
        return f"{next(iter(groups))} (every run)"
    return "; ".join(f"{text} ({', '.join(names)})" for text, names in groups.items())


def _control_line(comparison: Comparison) -> str:
    if comparison.note:
        return f"Control: {comparison.control}: {comparison.note}"
    line = f"Control: {comparison.control}"
    others = comparison.controls[1:]
    if others:
        kind = "control repeats" if comparison.design == "unpaired" else "noise controls"
        how = (" (the control again; in statistical plans every run, the control and the sets too, starts from the "
               "seed checkpoint perturbed at rounding level with a seed of its own: see the commands)"
               if comparison.design == "paired" else "")
        line += f"; {kind}: {', '.join(others)}{how}"
    return line + "."


def _rule_line(comparison: Comparison) -> str:
    tol = comparison.tolerance
    if comparison.criterion:
        return (f"{comparison.criterion} decides every set: it passes when it meets the criterion (a point of a "
                "sweep is a measurement: \"meets criterion\" or \"misses criterion\", see sweep_report.md); the "
                f"differences from the control below follow the tolerance ({comparison.mode} mode) and are reported, "
                "not judged.")
    if comparison.mode == "exact":
        grad = f"grad_norm_rtol {tol.grad_norm_rtol:g}" if tol.grad_norm_rtol > 0 else "grad norm reported only"
        return (f"every step's |loss diff| <= loss_atol {tol.loss_atol:g} and relative grad-norm diff <= {grad} "
                f"against the control; final window {tol.final_window:g}.")
    return (f"per observable ({', '.join(tol.observables)}), paired with the control family's mean step by step: "
            f"(1) equivalence of the final-window ({tol.final_window:g} of the steps) mean difference within the "
            f"margin (two one-sided t-tests, alpha {tol.alpha:g}; H0: |offset| >= margin); (2) no drift (slope of the "
            f"difference tested against the noise controls' slopes, alpha {tol.alpha:g}, judged only when it moves "
            "the difference by more than the margin over the run). The noise SD comes from the spread of the "
            "control family's own final-window means (its runs are the replicates, so it holds whatever the "
            "autocorrelation of the curves). Over the plan, an observable fails only when its failure is also "
            "significant once every judged (set, observable) is counted: Holm's step-down at the plan's false-fail "
            f"level {tol.plan_false_fail:g}, so each set is held to a bound of its own (below). Rule and hypotheses: "
            "protocol/verdict/decision.py, protocol/verdict/family_wise.py.")


def _details(comparison: Comparison) -> list[str]:
    if not comparison.results:
        return []
    if comparison.mode == "exact":
        lines = ["## Details", ""]
        rows = [[r.name, str(r.steps_compared), _missing(r), str(r.first_diverging_step or "-"),
                 fmt_diff(r.final_window_diff, signed=True), fmt_diff(r.grad_norm_max_rel_diff),
                 fmt_diff(r.grad_norm_first_rel_diff), fmt_diff(r.lr_max_rel_diff)] for r in comparison.results]
        return lines + _markdown_table(["set", "steps", "missing steps", "first diverging step", "final-window diff",
                                        "grad norm max rel diff", "grad norm step-1 rel diff", "lr max rel diff"],
                                       rows) + [""]
    return details_section(comparison)


def _missing(r: SetResult) -> str:
    if not (r.missing_in_test or r.missing_in_control):
        return "0"
    return f"{len(r.missing_in_test)} in test, {len(r.missing_in_control)} in control"


def _failures(comparison: Comparison) -> list[str]:
    failing = [r for r in comparison.results if r.failed]
    if not failing and not comparison.not_compared:
        return []
    lines = ["## Sets that miss the criterion, and runs without a verdict" if comparison.criterion else "## Failures",
             ""]
    for r in failing:
        where = f" (first diverging step: {r.first_diverging_step})" if r.first_diverging_step is not None else ""
        expected = " [positive control: expected]" if r.expect == "fail" else ""
        lines.append(f"- **{r.name}**{expected}: {r.reason}{where}")
    lines += [f"- **{m.name}**: {m.verdict}: {m.reason}" for m in comparison.not_compared]
    return lines + [""]


def _criterion(comparison: Comparison) -> list[str]:
    """Every set's value against the criterion, passing ones too (the verdict table shows the
    tolerance's numbers)."""
    if not comparison.criterion:
        return []
    lines = ["## Criterion", "", f"{comparison.criterion}:", ""]
    lines += [f"- **{r.name}**: {r.reason}" for r in comparison.results]
    lines += [f"- **{m.name}**: {m.verdict}: {m.reason}" for m in comparison.not_compared]
    return lines + [""]


def performance(curves: Sequence[Curve]) -> dict[str, dict[str, float | None]]:
    """Per run: median step time and tokens/s over its logged steps, largest peak memory."""
    def stat(curve: Curve, key: str, fn) -> float | None:
        values = np.asarray(curve.series(key) or [], dtype=np.float64)
        values = values[np.isfinite(values)]
        return float(fn(values)) if len(values) else None

    return {c.name: {"step_time_s": stat(c, "step_time_s", np.median), "tokens_per_s": stat(c, "tokens_per_s", np.median),
                     "peak_memory_gib": stat(c, "peak_memory_gib", np.max)} for c in curves}


def _performance(figures: dict[str, dict[str, float | None]], controls: Sequence[str] = ()) -> list[str]:
    if not any(v is not None for run in figures.values() for v in run.values()):
        return []
    lines = ["## Performance (what each run measured)", "",
             "A technique that changes no number can still change these: they show it was applied.", ""]
    caveat = timing_caveat(figures, list(controls))
    if caveat:
        lines += [f"Caveat: {caveat}", ""]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows = [[name, fmt(f["step_time_s"], ".4f"), fmt(f["tokens_per_s"], ".0f"), fmt(f["peak_memory_gib"], ".3f")]
            for name, f in figures.items()]
    return lines + _markdown_table(["run", "step time (median s)", "tokens/s (median)", "peak memory (GiB)"], rows) + [""]


def _runs_section(runs: list[RunInfo], notes: dict[str, list[str]]) -> list[str]:
    """Every run as its record describes it, and what differs from the plan as written now."""
    lines = []
    changed = [run for run in runs[1:] if run.config_changes]
    if changed:
        lines += ["## Configuration differences from the control", ""]
        lines += [f"- **{run.name}**: {'; '.join(run.config_changes)}" for run in changed] + [""]
    lines += ["## Runs (from their records)", ""]
    lines += _markdown_table(["run", "layout", "steps", "status", "code", "torch", "device", "folder"],
                             [[r.name, r.layout, _text(r.steps), _text(r.status), _text(r.code), _text(r.torch),
                               _text(r.device), r.folder] for r in runs])
    commands = [run for run in runs if run.command]
    if commands:
        lines += ["", "<details><summary>Commands (as each run was started)</summary>", ""]
        lines += [f"- {run.name}: `{run.command}`" for run in commands] + ["", "</details>"]
    differing = [(name, found) for name, found in notes.items() if found]
    if differing:
        lines += ["", "These runs were made with something other than what the plan runs now; the rows above "
                      "describe what they ran (`protocol run PLAN --rerun-stale` runs them again):", ""]
        lines += [f"- **{name}**: {'; '.join(found)}" for name, found in differing]
    return lines + [""]


def _text(value) -> str:
    return "-" if value is None else str(value)


def markdown(comparison: Comparison, layouts: dict[str, str] | None = None, runs: list[RunInfo] | None = None,
             notes: dict[str, list[str]] | None = None, figures: dict | None = None) -> str:
    """The report.md text; `runs` and `notes` (what differs from the plan as written now) come
    from the runs' own records, `figures` from their metrics (performance)."""
    runs = runs or []
    lines = _head(comparison, runs)
    lines += detectable_section(comparison)
    lines += _criterion(comparison)
    lines += ["## Verdicts", ""] + _markdown_table(columns(comparison), _rows(comparison, layouts)) + [""]
    if comparison.mode == "statistical":
        # Under a [criterion] the tolerance's bounds are reported, not judged: no "why" table.
        lines += [] if comparison.criterion else why_section(comparison)
        lines += findings_markdown(find(comparison, figures))
    lines += where_section(comparison)
    lines += _details(comparison) + _failures(comparison) + _performance(figures or {}, comparison.controls)
    if runs:
        lines += _runs_section(runs, notes or {})
    expected = sum(1 for r in comparison.results if r.failed == (r.expect == "fail"))
    total = len(comparison.results) + len([m for m in comparison.not_compared if m.name not in comparison.controls])
    tally = f"{comparison.criterion}" if comparison.criterion else f"{expected}/{total} sets as expected"
    lines += [f"**Overall: {comparison.status}** ({tally})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- all of it
def write_report(comparison: Comparison, family: Curve | list[Curve], tests: list[Curve], out_dir: str | Path,
                 layouts: dict[str, str] | None = None, runs: list[RunInfo] | None = None,
                 notes: dict[str, list[str]] | None = None) -> dict[str, Path]:
    """Write report.md, report.json and the PNGs (loss.png, grad_norm.png, lr.png: those with
    data) into out_dir; returns the written paths keyed "markdown", "json" and the figure names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family = [family] if isinstance(family, Curve) else list(family)
    figures = performance([*family, *tests])
    paths = {"markdown": out / "report.md", "json": out / "report.json"}
    paths["markdown"].write_text(markdown(comparison, layouts, runs, notes, figures), encoding="utf-8")
    data = comparison_to_dict(comparison)
    names = [r.name for r in comparison.results] + [m.name for m in comparison.not_compared]
    data["status_line"] = status_line(comparison)
    data["layouts"] = {name: (layouts or {}).get(name, "") for name in names}
    data["runs"] = {run.name: {**run.to_dict(), "differs_from_plan": (notes or {}).get(run.name, [])}
                    for run in runs or []}
    data["performance"] = figures
    if comparison.mode == "statistical":
        report_extras(data, comparison, find(comparison, figures).to_dict())
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(encode(data), f, indent=1, allow_nan=False)
        f.write("\n")
    paths.update(write_plots(family, tests, comparison, out))
    paths.update(write_fingerprint_maps(comparison, out))
    logger.info("report written to %s", out)
    return paths

