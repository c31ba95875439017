"""The report's figures: for each of the loss, the gradient norm and the learning rate, the curves
(the control family thin, its mean or the control thick, every set) above their differences from
the reference, paired step by step (the noise controls' own differences grey, the margin or
tolerance dashed). PNG, drawn without pyplot's global state.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from protocol.compare import Comparison, common_steps, values_at
from protocol.curves import Curve

FIGURES = ("loss", "grad_norm", "lr")
TITLES = {"loss": "loss", "grad_norm": "gradient norm", "lr": "learning rate"}


def _figure():
    from matplotlib.figure import Figure

    return Figure(figsize=(10, 8), dpi=100, layout="constrained")


def reference_curve(family: list[Curve], comparison: Comparison) -> Curve:
    if comparison.mode == "exact" or len(family) == 1:
        return family[0]
    from protocol.compare import family_mean

    return family_mean(family)


def difference(key: str, values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The plotted difference: absolute for the loss, relative (test / reference - 1) otherwise."""
    if key == "loss":
        return values - reference
    with np.errstate(divide="ignore", invalid="ignore"):
        return values / reference - 1


def threshold(key: str, comparison: Comparison) -> float | None:
    """The dashed +- line of the difference panel: the tolerance (exact) or the margin (statistical)."""
    tol = comparison.tolerance
    if comparison.mode == "exact":
        return {"loss": tol.loss_atol, "grad_norm": tol.grad_norm_rtol or None}.get(key)
    margins = {n.observable: n.margin for n in comparison.noise}
    if key not in margins:
        return None
    return margins[key] if key == "loss" else math.expm1(margins[key])


def plot_observable(key: str, family: list[Curve], tests: list[Curve], comparison: Comparison, path: Path) -> bool:
    """Draw `key`'s curves and paired differences into `path`; False (nothing written) when no
    run logged it."""
    if family[0].series(key) is None:
        return False
    reference = reference_curve(family, comparison)
    verdicts = {r.name: r for r in comparison.results}
    fig = _figure()
    top, bottom = fig.subplots(2, 1, sharex=True)
    for i, member in enumerate(family):
        thick = i == 0 and reference is member
        color = "black" if thick else ("0.35" if i == 0 else "0.7")  # the control darker than its noise controls
        top.plot(member.steps, member.series(key), color=color, linewidth=2.0 if thick else 0.7,
                 label=f"control {member.name}" if i == 0 else ("noise controls" if i == 1 else None))
        if not thick:
            steps = common_steps([member, reference])
            bottom.plot(steps, difference(key, values_at(member, key, steps), values_at(reference, key, steps)),
                        color=color, linewidth=0.7)
    if reference is not family[0]:
        top.plot(reference.steps, reference.series(key), color="black", linewidth=2.0, label="control family mean")
    for j, test in enumerate(tests):
        if test.series(key) is None:
            continue
        color = f"C{j % 10}"
        label = f"{test.name} ({verdicts[test.name].outcome})" if test.name in verdicts else test.name
        top.plot(test.steps, test.series(key), color=color, linewidth=1.1, label=label)
        steps = common_steps([test, reference])
        bottom.plot(steps, difference(key, values_at(test, key, steps), values_at(reference, key, steps)), color=color,
                    linewidth=1.1)
    limit = threshold(key, comparison)
    if limit:
        if comparison.mode == "exact":
            for sign in (1, -1):  # every step is judged
                bottom.axhline(sign * limit, color="black", linestyle="--", linewidth=0.9,
                               label="tolerance" if sign > 0 else None)
        else:
            draw_window_means(bottom, key, verdicts, limit)
        _symlog_if_far(bottom, tests, key, reference, limit)
    bottom.axhline(0.0, color="0.5", linewidth=0.6)
    top.set_ylabel(TITLES[key])
    bottom.set_ylabel(f"{'difference' if key == 'loss' else 'relative difference'} from the "
                      f"{'control' if reference is family[0] else 'family mean'}")
    bottom.set_xlabel("step")
    top.set_title(f"{TITLES[key].capitalize()}: curves and paired differences ({comparison.design})")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize="small")
    fig.savefig(path, format="png")
    return True


def draw_window_means(ax, key: str, verdicts: dict, margin: float) -> None:
    """Statistical mode judges the mean difference over the final window, not single steps: draw
    the margin over that window only, and each set's window mean as a thick segment on it."""
    window = None
    for j, result in enumerate(verdicts.values()):
        verdict = next((o for o in result.observables if o.observable == key), None)
        if verdict is None or verdict.window_first_step is None:
            continue
        window = (verdict.window_first_step, result.steps[-1])
        mean = verdict.diff if key == "loss" else math.expm1(verdict.diff)
        ax.hlines(mean, *window, colors=f"C{j % 10}", linewidth=3.0)
    if window:
        for sign in (1, -1):
            ax.hlines(sign * margin, *window, colors="black", linestyles="--", linewidth=1.0,
                      label="margin of the final-window mean (thick: each set's)" if sign > 0 else None)


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

