"""Statistical mode's difference panels: why each set passed or failed, drawn in the units the
rule judges (nats for the loss, the log ratio for the gradient norm).

Left, over the steps: every run's paired difference from the control family's mean, smoothed
over a few steps; the family's own noise as a band (+-BAND_SIGMAS standard deviations of a
member's difference at each step, smoothed the same way) with the noise controls' own lines on
it; the final window, which is what the rule judges, shaded. Right, the final window only: per
set its mean difference D with its noise SD as an error bar, over a shaded column from -bound to
+bound, the |D| from which that set fails as applied (ObservableVerdict.bound: the margin's floor
or the plan-level bound, whichever is larger; it differs between sets). A point outside its
column failed; a point inside one that failed drifts (the mark says so).

Both share one y-scale, fitted to what is judged (the bounds and the sets' D) rather than to the
largest difference: a set far outside (a gross positive control) is drawn at the edge with an
arrow and its value, so that it cannot flatten the others onto zero.
"""

from __future__ import annotations

import math

import numpy as np

from protocol.verdict.alignment import common_steps, transformed
from protocol.verdict.curves import Curve
from protocol.verdict.decision import SMOOTHING
from protocol.verdict.results import Comparison, SetResult

BAND_SIGMAS = 2.0
"""Half-width of the noise band in a member's difference SDs: a correct set's smoothed line
stays inside it at about 95% of the steps."""
FAR = 3.0
"""A set whose |D| exceeds FAR x the largest bound is off the scale (arrow and value)."""
HEADROOM = 1.15
UNITS = {"loss": "nats", "grad_norm": "log ratio, about relative"}


def smooth(values: np.ndarray, half: int = SMOOTHING) -> np.ndarray:
    """Centred moving average over 2 half + 1 steps (fewer at the ends), NaN-aware: a skipped
    step is left out of its neighbours' means and stays a gap itself."""
    finite = np.isfinite(values)
    kernel = np.ones(2 * half + 1)
    total = np.convolve(np.where(finite, values, 0.0), kernel, "same")
    count = np.convolve(finite.astype(float), kernel, "same")
    with np.errstate(invalid="ignore", divide="ignore"):
        out = total / count
    return np.where(finite, out, np.nan)


def family_rows(family: list[Curve], key: str, steps: list[int]) -> np.ndarray:
    """(members, steps) of the judged values (log for the gradient norm)."""
    return np.array([transformed(c, key, steps) for c in family])


def noise_band(rows: np.ndarray) -> np.ndarray:
    """Per step, the standard deviation of one more member's smoothed difference from the family
    mean: the members' smoothed deviations' spread (K degrees of freedom) times sqrt(1 + 1/(K+1)),
    then RMS-smoothed over the steps, since K + 1 values alone make a ragged edge."""
    members = len(rows)
    deviations = np.array([smooth(row) for row in rows - rows.mean(axis=0)])
    spread = np.std(deviations, axis=0, ddof=1) * math.sqrt(1 + 1 / members)
    return np.sqrt(smooth(spread ** 2))


def judged_ylim(bounds: list[float], diffs: list[float], sds: list[float],
                also: list[float] = (), far: float = FAR) -> tuple[float, list[int]]:
    """(half-height of the difference panels, the indices of the sets drawn off the scale).

    The scale holds every applied bound and every set's |D| + its noise SD, except sets whose
    |D| exceeds `far` x the largest bound, and `also` (the noise controls' own window means, the
    band over the final window); a little headroom above."""
    finite_bounds = [b for b in bounds if math.isfinite(b) and b > 0]
    reach = max(finite_bounds, default=0.0)
    near = [i for i, d in enumerate(diffs) if not reach or abs(d) <= far * reach]
    extent = [reach, *(abs(diffs[i]) + (sds[i] if math.isfinite(sds[i]) else 0.0) for i in near),
              *(abs(a) for a in also if math.isfinite(a))]
    limit = HEADROOM * max(extent, default=0.0) or 1.0
    return limit, [i for i, d in enumerate(diffs) if abs(d) > limit]


def draw_differences(fig, grid, top, key: str, family: list[Curve], tests: list[Curve],
                     comparison: Comparison) -> None:
    """The two panels below `top` in `grid`'s second row (see the module's description)."""
    left = fig.add_subplot(grid[1, 0], sharex=top)
    right = fig.add_subplot(grid[1, 1], sharey=left)
    steps = common_steps(family)
    rows = family_rows(family, key, steps)
    reference = rows.mean(axis=0)
    band = BAND_SIGMAS * noise_band(rows)
    left.fill_between(steps, -band, band, color="0.85", linewidth=0,
                      label=f"noise: +-{BAND_SIGMAS:g} SD of a member's difference")
    for i, row in enumerate(rows[1:]):
        left.plot(steps, smooth(row - reference), color="0.4", linewidth=0.8,
                  label="noise controls" if i == 0 else None)
    results = {r.name: r for r in comparison.results}
    judged = [(j, results.get(t.name), verdict_of(results.get(t.name), key)) for j, t in enumerate(tests)]
    for j, test in enumerate(tests):
        both = common_steps([*family, test])
        d = transformed(test, key, both) - family_rows(family, key, both).mean(axis=0)
        left.plot(both, smooth(d), color=f"C{j % 10}", linewidth=1.3)
    judged = [(j, r, v) for j, r, v in judged if v is not None]
    window = next((v.window_first_step for _, _, v in judged if v.window_first_step is not None), None)
    if window is not None:
        left.axvspan(window, steps[-1], color="gold", alpha=0.15, linewidth=0, label="final window (judged)")
    members = member_window_means(comparison, key)
    tail = band[steps.index(window):] if window in steps else np.array([])
    final_band = float(np.nanmax(tail)) if np.isfinite(tail).any() else 0.0
    limit, off = judged_ylim([v.bound for _, _, v in judged], [v.diff for _, _, v in judged],
                             [v.noise_sd for _, _, v in judged], also=[*members, final_band])
    draw_final_window(right, judged, members, limit, {judged[i][0] for i in off})
    for ax in (left, right):
        ax.set_ylim(-limit, limit)
        ax.axhline(0.0, color="0.5", linewidth=0.6)
        ax.grid(True, alpha=0.3)
    left.set_ylabel(f"{'difference' if key == 'loss' else 'log ratio'} from the control family's mean "
                    f"({UNITS[key]}),\nmean over {2 * SMOOTHING + 1} steps")
    left.set_xlabel("step")
    # Above the panel, not on it: the lines fill the panel's whole height by design.
    left.legend(fontsize="small", loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=3, frameon=False)


def verdict_of(result: SetResult | None, key: str):
    if result is None:
        return None
    return next((o for o in result.observables if o.observable == key), None)


def member_window_means(comparison: Comparison, key: str) -> list[float]:
    """The control family's members' final-window means about the family's (NoiseSummary)."""
    summary = next((n for n in comparison.noise if n.observable == key), None)
    return list(summary.member_diffs.values()) if summary else []


def draw_final_window(ax, judged: list, members: list[float], limit: float, off: set[int]) -> None:
    """Per set: its column from -bound to +bound, D with its noise SD, failed marks; at x = 0 the
    noise controls' own window means."""
    ax.plot(np.zeros(len(members)), members, "o", color="0.4", markersize=4)
    names = ["control\nfamily"]
    for x, (j, result, v) in enumerate(judged, 1):
        color = f"C{j % 10}"
        if math.isfinite(v.bound):
            ax.fill_between([x - 0.35, x + 0.35], -v.bound, v.bound, color=color, alpha=0.18, linewidth=0)
            ax.hlines([-v.bound, v.bound], x - 0.35, x + 0.35, colors=color, linewidth=1.0)
        names.append(short(result.name))
        if j in off:
            draw_off_scale(ax, x, v, limit, color)
            continue
        ax.errorbar([x], [v.diff], yerr=[v.noise_sd], fmt="o" if v.passed else "X", color=color,
                    markersize=7 if v.passed else 9, capsize=4, linewidth=1.5)
        if not v.passed and v.drifting and abs(v.diff) < v.bound:
            ax.annotate("drifts", (x, v.diff), textcoords="offset points", xytext=(8, 0), fontsize="small",
                        color=color, va="center")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize="small")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_title("final window: mean diff +- noise SD;\nshaded: +- the bound it fails at (x: failed)",
                 fontsize="small")
    ax.tick_params(axis="y", labelleft=False)


def draw_off_scale(ax, x: float, v, limit: float, color: str) -> None:
    """An arrow at the panel's edge pointing the way of D, with its value and its noise SDs."""
    sign = 1.0 if v.diff > 0 else -1.0
    tip, tail = sign * limit * 0.97, sign * limit * 0.62
    ax.annotate("", xy=(x, tip), xytext=(x, tail),
                arrowprops={"arrowstyle": "-|>", "color": color, "linewidth": 2.0})
    sigmas = f"\n{abs(v.diff) / v.noise_sd:.0f} SD" if v.noise_sd > 0 else ""
    ax.annotate(f"{v.diff:+.2e}{sigmas}", (x, tail), textcoords="offset points", xytext=(0, -10 * sign),
                ha="center", va="top" if sign > 0 else "bottom", fontsize="x-small", color=color,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": color, "alpha": 0.9})


def short(name: str, width: int = 18) -> str:
    return name if len(name) <= width else name[:width - 1] + "..."
