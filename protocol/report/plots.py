"""The report's figures: for each of the loss, the gradient norm and the learning rate, the curves
(the control family thin, its mean or the control thick, every set) above their differences from
the reference, paired step by step. Exact mode, and the learning rate, which no mode judges: every
step's difference, the noise controls' grey, the tolerance dashed. Statistical mode's judged
observables: the noise as a band, and each set's final-window mean against the bound applied to
it (protocol.report.plot_verdicts). PNG, drawn without pyplot's global state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocol.report.plot_verdicts import draw_differences
from protocol.verdict.alignment import common_steps, values_at
from protocol.verdict.curves import Curve
from protocol.verdict.results import Comparison

FIGURES = ("loss", "grad_norm", "lr")
TITLES = {"loss": "loss", "grad_norm": "gradient norm", "lr": "learning rate"}


def _figure(size: tuple[float, float] = (10, 8)):
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=100, layout="constrained")


def judged(key: str, comparison: Comparison) -> bool:
    """Statistical mode judged `key` (it has the family's noise): drawn by protocol.report.plot_verdicts."""
    return comparison.mode == "statistical" and any(n.observable == key for n in comparison.noise)


def reference_curve(family: list[Curve], comparison: Comparison) -> Curve:
    if comparison.mode == "exact" or len(family) == 1:
        return family[0]
    from protocol.verdict.statistical_mode import family_mean

    return family_mean(family)


def difference(key: str, values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The plotted difference: absolute for the loss, relative (test / reference - 1) otherwise."""
    if key == "loss":
        return values - reference
    with np.errstate(divide="ignore", invalid="ignore"):
        return values / reference - 1


def threshold(key: str, comparison: Comparison) -> float | None:
    """Exact mode's dashed +- line of the difference panel: the tolerance (statistical mode judges
    final-window means, drawn by protocol.report.plot_verdicts, and not the learning rate)."""
    tol = comparison.tolerance
    if comparison.mode == "exact":
        return {"loss": tol.loss_atol, "grad_norm": tol.grad_norm_rtol or None}.get(key)
    return None


def plot_observable(key: str, family: list[Curve], tests: list[Curve], comparison: Comparison, path: Path) -> bool:
    """Draw `key`'s curves and paired differences into `path`; False (nothing written) when no
    run logged it."""
    if family[0].series(key) is None:
        return False
    reference = reference_curve(family, comparison)
    verdicts = {r.name: r for r in comparison.results}
    if judged(key, comparison):
        fig = _figure((11, 8.5))
        grid = fig.add_gridspec(2, 2, width_ratios=(3, 1), height_ratios=(1, 1.4))
        top = fig.add_subplot(grid[0, :])
        draw_curves(top, key, family, tests, reference, verdicts)
        draw_differences(fig, grid, top, key, family, tests, comparison)
        finish(fig, top, key, comparison, path)
        return True
    fig = _figure()
    top, bottom = fig.subplots(2, 1, sharex=True)
    draw_curves(top, key, family, tests, reference, verdicts)
    for i, member in enumerate(family):
        if member is not reference:
            steps = common_steps([member, reference])
            bottom.plot(steps, difference(key, values_at(member, key, steps), values_at(reference, key, steps)),
                        color="0.35" if i == 0 else "0.7", linewidth=0.7)
    for j, test in enumerate(tests):
        if test.series(key) is not None:
            steps = common_steps([test, reference])
            bottom.plot(steps, difference(key, values_at(test, key, steps), values_at(reference, key, steps)),
                        color=f"C{j % 10}", linewidth=1.1)
    limit = threshold(key, comparison)
    if limit:  # exact mode: every step is judged
        for sign in (1, -1):
            bottom.axhline(sign * limit, color="black", linestyle="--", linewidth=0.9,
                           label="tolerance" if sign > 0 else None)
        _symlog_if_far(bottom, tests, key, reference, limit)
    bottom.axhline(0.0, color="0.5", linewidth=0.6)
    bottom.set_ylabel(f"{'difference' if key == 'loss' else 'relative difference'} from the "
                      f"{'control' if reference is family[0] else 'family mean'}")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    if bottom.get_legend_handles_labels()[1]:
        bottom.legend(fontsize="small")
    finish(fig, top, key, comparison, path)
    return True


def draw_curves(top, key: str, family: list[Curve], tests: list[Curve], reference: Curve, verdicts: dict) -> None:
    """The upper panel: the control family thin, its mean or the control thick, each set with its
    outcome."""
    for i, member in enumerate(family):
        thick = i == 0 and reference is member
        color = "black" if thick else ("0.35" if i == 0 else "0.7")  # the control darker than its noise controls
        top.plot(member.steps, member.series(key), color=color, linewidth=2.0 if thick else 0.7,
                 label=f"control {member.name}" if i == 0 else ("noise controls" if i == 1 else None))
    if reference is not family[0]:
        top.plot(reference.steps, reference.series(key), color="black", linewidth=2.0, label="control family mean")
    for j, test in enumerate(tests):
        if test.series(key) is None:
            continue
        label = f"{test.name} ({verdicts[test.name].outcome})" if test.name in verdicts else test.name
        top.plot(test.steps, test.series(key), color=f"C{j % 10}", linewidth=1.1, label=label)


def finish(fig, top, key: str, comparison: Comparison, path: Path) -> None:
    top.set_ylabel(TITLES[key])
    top.set_title(f"{TITLES[key].capitalize()}: curves and paired differences ({comparison.design})")
    top.grid(True, alpha=0.3)
    if top.get_legend_handles_labels()[1]:
        top.legend(fontsize="small")
    fig.savefig(path, format="png")


def _symlog_if_far(ax, tests: list[Curve], key: str, reference: Curve, limit: float) -> None:
    """A set far outside the margin would flatten the others onto zero: turn the axis
    symmetric-log (linear within the margin) when some difference exceeds 100x it."""
    largest = 0.0
    for test in tests:
        if test.series(key) is None:
            continue
        steps = common_steps([test, reference])
        d = difference(key, values_at(test, key, steps), values_at(reference, key, steps))
        finite = np.abs(d[np.isfinite(d)])
        largest = max(largest, float(finite.max()) if len(finite) else 0.0)
    if largest > 100 * limit:
        ax.set_yscale("symlog", linthresh=limit)


def write_plots(family: list[Curve], tests: list[Curve], comparison: Comparison, out: Path) -> dict[str, Path]:
    """One PNG per figure that has data (`<key>.png`); an older one without data now is removed."""
    written = {}
    for key in FIGURES:
        path = out / f"{key}.png"
        if family and plot_observable(key, family, tests, comparison, path):
            written[key] = path
        else:
            path.unlink(missing_ok=True)
    return written

