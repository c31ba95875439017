"""The sweep report of a plan with a [criterion], written beside report.md as sweep_report.md,
sweep_report.json and sweep-<slug>.png (the measure against the syncs), and printed: the tables
of protocol.verdict.sweep_table, one per sweep, with their answer lines.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict
from pathlib import Path

from protocol.plan.model import slugify
from protocol.verdict.sweep_table import Row, SweepReport, SweepTable

COLUMNS = ("set", "syncs per forward", "{metric}", "vs control", "meets criterion", "time per step (s)")


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else ("nan" if math.isnan(value) else format(value, spec))


def cells(row: Row) -> list[str]:
    relative = "-" if row.vs_control is None else f"{row.vs_control * 100:+.2f}%"
    return [row.name, fmt(row.syncs, "g"), fmt(row.value, ".5g"), relative, row.meets, fmt(row.step_time, ".4f")]


def header(report: SweepReport) -> list[str]:
    return [column.format(metric=report.metric) for column in COLUMNS]


def plain(report: SweepReport) -> str:
    """The tables and answer lines as aligned text, for the terminal."""
    lines = [report.criterion]
    for table in report.tables:
        rows = [header(report)] + [cells(row) for row in table.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        text.insert(1, "  ".join("-" * w for w in widths))
        lines += ["", f"sweep {table.sweep.name!r}:", *text, f"{table.sweep.name}: {table.answer}"]
        lines += [table.search] if table.search else []
        lines += [f"warning: {w}" for w in table.warnings]
    return "\n".join(lines)


def markdown(report: SweepReport) -> str:
    lines = ["# Sweep report", "", f"**{report.criterion}**", "",
             "syncs per forward: the tensor-parallel synchronizations of one forward pass each run counted "
             "(metrics.count_collectives; n/a when it did not); vs control: the set's value relative to the "
             "control's; time per step: mean seconds per training step after the learning-rate warm-up.", ""]
    for table in report.tables:
        lines += [f"## Sweep {table.sweep.name}", "", "| " + " | ".join(header(report)) + " |",
                  "|" + "|".join("---" for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells(row)) + " |" for row in table.rows]
        lines += ["", f"**{table.answer}**", ""]
        lines += [f"{table.search[0].upper()}{table.search[1:]}", ""] if table.search else []
        notes = [f"- {row.name}: {row.note}" for row in table.rows if row.note]
        lines += notes + ([""] if notes else [])
        lines += [f"Warning: {w}" for w in table.warnings] + ([""] if table.warnings else [])
        if table.figure is not None:
            lines += [f"![{table.sweep.name}]({table.figure.name})", ""]
    return "\n".join(lines)


def to_dict(report: SweepReport) -> dict:
    def clean(value):
        return None if isinstance(value, float) and not math.isfinite(value) else value

    return {"criterion": report.criterion, "metric": report.metric, "sweeps": [
        {"name": t.sweep.name, "answer": t.answer, "search": t.search, "warnings": t.warnings,
         "figure": t.figure.name if t.figure else None,
         "rows": [{k: clean(v) for k, v in asdict(row).items()} for row in t.rows]} for t in report.tables]}


# ---------------------------------------------------------------------------------------------
# Files


def write_sweep_report(report: SweepReport, threshold: float | None, out: Path) -> dict[str, Path]:
    """sweep_report.md, sweep_report.json and one PNG per sweep that has points to draw."""
    for table in report.tables:
        path = out / f"sweep-{slugify(table.sweep.name)}.png"
        table.figure = path if plot(table, report.metric, threshold, path) else None
    paths = {"sweep markdown": out / "sweep_report.md", "sweep json": out / "sweep_report.json"}
    paths["sweep markdown"].write_text(markdown(report), encoding="utf-8")
    paths["sweep json"].write_text(json.dumps(to_dict(report), indent=1) + "\n", encoding="utf-8")
    paths.update({f"sweep figure {t.sweep.name}": t.figure for t in report.tables if t.figure is not None})
    return paths


def plot(table: SweepTable, metric: str, threshold: float | None, path: Path) -> bool:
    """The measure against the syncs per forward: the control a black star, the points green
    (meet) or red (miss), the bound dashed. False (an older figure removed) when no run has both
    numbers."""
    drawn = [row for row in table.rows if row.syncs is not None and row.value is not None
             and math.isfinite(row.value)]
    if not drawn:
        path.unlink(missing_ok=True)
        return False
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    ax = fig.subplots()
    labelled = set()
    for row in drawn:
        if row.meets == "control":
            ax.scatter([row.syncs], [row.value], marker="*", s=200, color="black", label="control", zorder=3)
        else:
            kind = "meets the criterion" if row.meets == "yes" else "misses it"
            ax.scatter([row.syncs], [row.value], color="tab:green" if row.meets == "yes" else "tab:red", zorder=2,
                       label=None if kind in labelled else kind)
            labelled.add(kind)
        label = row.name.removeprefix(f"{table.sweep.name} ")  # the sweep's name is in the title
        ax.annotate(label, (row.syncs, row.value), textcoords="offset points", xytext=(5, 5), fontsize="small")
    if threshold is not None:
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1.0, label=f"criterion: <= {threshold:.5g}")
    ax.margins(x=0.15, y=0.1)  # room for the names beside the points
    ax.set_xlabel("tensor-parallel syncs per forward pass (measured)")
    ax.set_ylabel(metric)
    ax.set_title(textwrap.fill(f"Sweep {table.sweep.name}: {table.answer}", width=80), fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, format="png")
    return True
