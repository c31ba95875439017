"""The verdict written out: a markdown report, a JSON file, and two PNG plots.

* ``report.md``: the mode, the trainer code of the runs and the tolerance, one table row per test
  set (and a FAILED / NOT RUN row per run without a curve), the reason of each failure, the runs
  as their own records describe them, and an overall PASS/FAIL line.
* ``report.json``: every field of the `Comparison` (per-step differences included); non-finite
  numbers are written as the strings "nan", "inf", "-inf" so that strict JSON readers accept it,
  and `comparison_from_dict` turns it back into a `Comparison` (the report's own additions,
  ``layouts`` and ``runs``, are left out).
* ``loss_curves.png``: every loss curve over the control's; ``loss_diffs.png``: each set's
  difference from the control per step, with its tolerance (or band) dashed.

Numbers are printed with `fmt_loss` / `fmt_diff`, which keep diffs such as 2.4e-07 readable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from protocol.compare import Comparison, NotCompared, SetResult, mean_curve
from protocol.curves import Curve
from protocol.records import RunInfo, code_summary
from protocol.tolerance import Tolerance

logger = logging.getLogger(__name__)

REPORT_EXTRAS = ("layouts", "runs")
COLUMNS = ("set", "layout", "initial", "final", "max abs diff", "mean abs diff", "final diff", "verdict")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ---------------------------------------------------------------- number formats
def fmt_loss(value: float | None) -> str:
    """A loss value: 6 significant digits."""
    if value is None:
        return "-"
    return f"{value:.6g}"


def fmt_diff(value: float | None, signed: bool = False) -> str:
    """A difference: scientific notation so that 2.4e-07 and 3.1e-02 stay comparable at a glance."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:+.2e}" if signed else f"{value:.2e}"


def _verdict(result: SetResult) -> str:
    return "PASS" if result.verdict else "FAIL"


def _rows(comparison: Comparison, layouts: dict[str, str] | None) -> list[list[str]]:
    """One row per judged set, then one per run that has no curve (FAILED / NOT RUN)."""
    layouts = layouts or {}
    rows = [
        [r.name, layouts.get(r.name, ""), fmt_loss(r.initial_loss), fmt_loss(r.final_loss),
         fmt_diff(r.max_abs_diff), fmt_diff(r.mean_abs_diff), fmt_diff(r.final_diff, signed=True), _verdict(r)]
        for r in comparison.results
    ]
    rows += [[m.name, layouts.get(m.name, ""), "-", "-", "-", "-", "-", m.verdict] for m in comparison.not_compared]
    return rows


# ---------------------------------------------------------------- tables
def format_table(comparison: Comparison, layouts: dict[str, str] | None = None) -> str:
    """The summary table as aligned plain text for a terminal."""
    rows = [list(COLUMNS)] + _rows(comparison, layouts)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731 - a set name may contain a pipe
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return lines


def _tolerance_line(tol: Tolerance) -> str:
    if tol.mode == "exact":
        grad = f"grad_norm_rtol {tol.grad_norm_rtol:g}" if tol.grad_norm_rtol > 0 else "grad norm reported only"
        return f"Tolerance: per-step |loss diff| <= loss_atol {tol.loss_atol:g}; {grad}; final window {tol.final_window:g}."
    return (f"Tolerance: final-window ({tol.final_window:g}) mean within band = max(relative_floor "
            f"{tol.relative_floor:g} x control mean, noise_multiplier {tol.noise_multiplier:g} x seed spread); "
            f"trend significant above |z| {tol.trend_z:g}.")


def markdown(comparison: Comparison, layouts: dict[str, str] | None = None,
             runs: list[RunInfo] | None = None, notes: dict[str, list[str]] | None = None) -> str:
    """The report.md text; `runs` and `notes` (what differs from the plan as written now) come
    from the runs' own records."""
    lines = [f"# Convergence report: {comparison.mode} mode", "", _control_line(comparison), ""]
    code = code_summary(runs or [])
    if code:
        lines += [f"Code: {code}", ""]
    lines += [_tolerance_line(comparison.tolerance), ""]
    lines += _markdown_table(list(COLUMNS), _rows(comparison, layouts))
    if comparison.results:
        lines += ["", "## Details", ""]
        lines += _markdown_table(
            ["set", "steps", "missing steps", "first diverging step", "threshold", "final-window diff",
             "trend slope/step", "trend z", "grad norm max rel diff", "grad norm first-step rel diff"]
            + (["noise spread", "band"] if comparison.mode == "statistical" else []),
            [_detail_row(r, comparison.mode) for r in comparison.results])
    failing = [r for r in comparison.results if not r.verdict]
    if failing or comparison.not_compared:
        lines += ["", "## Failures", ""]
        for r in failing:
            first = r.first_diverging_step if r.first_diverging_step is not None else "none"
            lines.append(f"- **{r.name}**: {r.reason} (first step with |diff| > {fmt_diff(r.threshold)}: {first})")
        lines += [f"- **{m.name}**: {m.verdict}: {m.reason}" for m in comparison.not_compared]
    if runs:
        lines += ["", *_runs_section(runs, notes or {})]
    judged = sum(r.verdict for r in comparison.results)
    total = len(comparison.results) + len([m for m in comparison.not_compared if m.name not in comparison.controls])
    lines += ["", f"**Overall: {'PASS' if comparison.passed else 'FAIL'}** ({judged}/{total} sets pass)", ""]
    return "\n".join(lines)


def _control_line(comparison: Comparison) -> str:
    if comparison.note:
        return f"Control: {comparison.control}: {comparison.note}"
    control = f"Control: {comparison.control}"
    if len(comparison.controls) > 1:
        control += f" (repeats: {', '.join(comparison.controls)})"
    if comparison.results:
        first = comparison.results[0]
        control += (f"; loss {fmt_loss(first.control_initial_loss)} at the first common step, "
                    f"{fmt_loss(first.control_final_loss)} at the last")
    return control


def _runs_section(runs: list[RunInfo], notes: dict[str, list[str]]) -> list[str]:
    """Every run as its record describes it, and what differs from the plan as written now."""
    lines = ["## Runs (from their records)", ""]
    lines += _markdown_table(["run", "layout", "steps", "status", "code", "torch", "folder"],
                             [[r.name, r.layout, _text(r.steps), _text(r.status), _text(r.code), _text(r.torch),
                               r.folder] for r in runs])
    differing = [(name, found) for name, found in notes.items() if found]
    if differing:
        lines += ["", "These runs were made with something other than what the plan runs now; the rows above "
                      "describe what they ran (`protocol run PLAN --rerun-stale` runs them again):", ""]
        lines += [f"- **{name}**: {'; '.join(found)}" for name, found in differing]
    return lines


def _text(value) -> str:
    return "-" if value is None else str(value)


def _detail_row(r: SetResult, mode: str) -> list[str]:
    missing = len(r.missing_in_test) + len(r.missing_in_control)
    row = [r.name, str(r.steps_compared), f"{len(r.missing_in_test)} in test, {len(r.missing_in_control)} in control"
           if missing else "0", str(r.first_diverging_step) if r.first_diverging_step is not None else "-",
           fmt_diff(r.threshold), fmt_diff(r.final_window_diff, signed=True), fmt_diff(r.trend_slope, signed=True),
           f"{r.trend_z:.2f}" if math.isfinite(r.trend_z) else str(r.trend_z),
           fmt_diff(r.grad_norm_max_rel_diff), fmt_diff(r.grad_norm_first_rel_diff)]
    if mode == "statistical":
        row += [fmt_diff(r.noise_spread), fmt_diff(r.band)]
    return row


# ---------------------------------------------------------------- JSON
def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def comparison_to_dict(comparison: Comparison) -> dict:
    """Every field of the comparison as strict-JSON-ready data."""
    return _encode(dataclasses.asdict(comparison))


def _decode_floats(cls, data: dict) -> dict:
    """Turn "nan"/"inf" strings back into floats in the fields annotated as float."""
    out = dict(data)
    for f in dataclasses.fields(cls):
        if "float" not in str(f.type) or f.name not in out:
            continue
        value = out[f.name]
        if isinstance(value, str):
            out[f.name] = _NON_FINITE[value]
        elif isinstance(value, list):
            out[f.name] = [_NON_FINITE[v] if isinstance(v, str) else v for v in value]
    return out


def comparison_from_dict(data: dict) -> Comparison:
    """The inverse of `comparison_to_dict` (e.g. for a report.json read back)."""
    results = [SetResult(**_decode_floats(SetResult, r)) for r in data["results"]]
    tolerance = Tolerance(**data["tolerance"])
    not_compared = [NotCompared(**m) for m in data.get("not_compared", [])]
    # "layouts" and "runs" are report metadata that write_report adds next to the comparison's own fields
    fields = {k: v for k, v in data.items() if k not in ("results", "tolerance", "not_compared") + REPORT_EXTRAS}
    return Comparison(tolerance=tolerance, results=results, not_compared=not_compared, **fields)


# ---------------------------------------------------------------- plots
def _figure():
    """A figure outside pyplot: no global backend switch, nothing left open."""
    from matplotlib.figure import Figure

    return Figure(figsize=(9, 5.5), dpi=110, layout="constrained")


def plot_loss_curves(control_curves: list[Curve], test_curves: list[Curve], mode: str, path: Path) -> None:
    """The controls (repeats thin, their mean or the single control thick) and every test set."""
    fig = _figure()
    ax = fig.add_subplot()
    if len(control_curves) > 1:
        for c in control_curves:
            ax.plot(c.steps, c.loss, color="0.6", linewidth=0.7, label=f"control repeat {c.name}")
    reference = mean_curve(control_curves) if mode == "statistical" and len(control_curves) > 1 else control_curves[0]
    ax.plot(reference.steps, reference.loss, color="black", linewidth=2.2, label=f"control {reference.name}")
    for t in test_curves:
        ax.plot(t.steps, t.loss, linewidth=1.2, label=t.name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss curves")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, format="png")


def plot_loss_diffs(comparison: Comparison, path: Path) -> None:
    """Each set's test - control per step; dashed lines at +-threshold (loss_atol or the band).

    A set far outside its tolerance would flatten the others onto zero on a linear axis, so the
    y axis turns symmetric-log (linear within the tolerance) when some diff exceeds 100x it.
    """
    fig = _figure()
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(comparison.results))]
    largest, smallest_threshold = 0.0, math.inf
    for r, color in zip(comparison.results, colors):
        ax.plot(r.steps, r.loss_diff, color=color, linewidth=1.2, label=f"{r.name} ({_verdict(r)})")
        finite = [abs(d) for d in r.loss_diff if math.isfinite(d)]
        largest = max([largest] + finite)
        if math.isfinite(r.threshold) and r.threshold > 0:
            smallest_threshold = min(smallest_threshold, r.threshold)
    kind = "tolerance" if comparison.mode == "exact" else "band"
    if len({r.threshold for r in comparison.results}) == 1:
        pairs = [(comparison.results[0].threshold, "black", f"{kind} +-{fmt_diff(comparison.results[0].threshold)}")]
    else:  # statistical bands differ per set when their common steps differ
        pairs = [(r.threshold, c, f"{kind} +-{fmt_diff(r.threshold)} ({r.name})")
                 for r, c in zip(comparison.results, colors)]
    for threshold, color, label in pairs:
        if math.isfinite(threshold):
            ax.axhline(threshold, color=color, linestyle="--", linewidth=0.9, label=label)
            ax.axhline(-threshold, color=color, linestyle="--", linewidth=0.9)
    ax.axhline(0.0, color="0.5", linewidth=0.6)
    if math.isfinite(smallest_threshold) and largest > 100 * smallest_threshold:
        ax.set_yscale("symlog", linthresh=smallest_threshold)
    ax.set_xlabel("step")
    ax.set_ylabel("loss diff (test - control)")
    ax.set_title(f"Loss difference from the control ({comparison.mode} mode)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, format="png")


# ---------------------------------------------------------------- all of it
def write_report(
    comparison: Comparison,
    control_curves: Curve | list[Curve],
    test_curves: dict[str, Curve] | list[Curve],
    out_dir: str | Path,
    layouts: dict[str, str] | None = None,
    runs: list[RunInfo] | None = None,
    notes: dict[str, list[str]] | None = None,
) -> dict[str, Path]:
    """Write report.md, report.json, loss_curves.png and loss_diffs.png into out_dir.

    `layouts` maps a run name to a description of its layout for the table; `runs` describes
    each run from its record and `notes` what differs from the plan now (both optional). Returns
    the written paths keyed "markdown", "json", "loss_curves", "loss_diffs". A plot with nothing
    to draw (no control curve, no set judged) is not written, and an older one is removed so it
    is not taken for this report's.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    controls = [control_curves] if isinstance(control_curves, Curve) else list(control_curves)
    if isinstance(test_curves, dict):
        tests = [dataclasses.replace(c, name=key) for key, c in test_curves.items()]
    else:
        tests = list(test_curves)
    paths = {"markdown": out / "report.md", "json": out / "report.json"}
    paths["markdown"].write_text(markdown(comparison, layouts, runs, notes), encoding="utf-8")
    with open(paths["json"], "w", encoding="utf-8") as f:
        data = comparison_to_dict(comparison)
        names = [r.name for r in comparison.results] + [m.name for m in comparison.not_compared]
        data["layouts"] = {name: (layouts or {}).get(name, "") for name in names}
        data["runs"] = {run.name: {**run.to_dict(), "differs_from_plan": (notes or {}).get(run.name, [])}
                        for run in runs or []}
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")
    plots = {"loss_curves": (bool(controls), lambda path: plot_loss_curves(controls, tests, comparison.mode, path)),
             "loss_diffs": (bool(comparison.results), lambda path: plot_loss_diffs(comparison, path))}
    for key, (drawable, draw) in plots.items():
        path = out / f"{key}.png"
        if drawable:
            draw(path)
            paths[key] = path
        else:
            path.unlink(missing_ok=True)
    logger.info("report written to %s", out)
    return paths
