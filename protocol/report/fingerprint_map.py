"""The fingerprint heat map of a test set that parts from the control: at the first deviating step,
one row per transformer block (and one for the modules outside the blocks), one column per module
and quantity, coloured by the entry's score (its difference from the control in units of what
correct layouts give; above 1 it deviates). PNG, drawn without pyplot's global state.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from protocol.verdict.fingerprints import ACTIVATIONS, LAYER, pattern_of

OUTSIDE = "outside blocks"
# Columns: the block activations, then each module's gradient, update and weight norm.
ACTIVATION_COLUMNS = (("attention_rms", "attention output RMS"), ("ffn_rms", "feed-forward output RMS"),
                      ("output_rms", "block output RMS"), ("grad_rms", "block gradient RMS"))
QUANTITY_SHORT = {"grad_norm": "grad", "update_norm": "update", "param_norm": "weight"}


def layout(scores: dict[tuple[str, str], float]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(row names, columns as (quantity, module, label)) of the entries that have a score."""
    blocks = sorted({entry for quantity, entry in scores if quantity in ACTIVATIONS}, key=int)
    modules: list[str] = []
    outside = False
    for quantity, entry in scores:
        if quantity in ACTIVATIONS:
            continue
        module = pattern_of(quantity, entry)[0].removeprefix("layers.*.").removesuffix(".weight")
        outside |= LAYER.match(entry) is None
        if module not in modules:
            modules.append(module)
    columns = [(q, "", label) for q, label in ACTIVATION_COLUMNS if any(k[0] == q for k in scores)]
    columns += [(q, m, f"{m} {short}") for m in modules for q, short in QUANTITY_SHORT.items()]
    return blocks + ([OUTSIDE] if outside else []), columns


def cell_key(row: str, quantity: str, module: str) -> tuple[str, str]:
    if not module:
        return quantity, row
    if row == "outside blocks":
        return quantity, f"{module}.weight"
    return quantity, f"layers.{row}.{module}.weight"


def draw_fingerprint_map(name: str, step: int, scores: dict[tuple[str, str], float], path: Path) -> None:
    """Write the heat map of one set's scores at its first deviating step to `path`."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    rows, columns = layout(scores)
    grid = np.full((len(rows), len(columns)), np.nan)
    for i, row in enumerate(rows):
        for j, (quantity, module, _) in enumerate(columns):
            score = scores.get(cell_key(row, quantity, module))
            if score is not None:
                grid[i, j] = math.log10(max(score, 1e-3))
    figure = Figure(figsize=(max(8, 0.32 * len(columns) + 3), 1.2 + 0.45 * len(rows)), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    top = max(3.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 3.0)
    image = axes.imshow(grid, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(vcenter=0.0, vmin=-3.0, vmax=top))
    axes.set_xticks(range(len(columns)), [label for _, _, label in columns], rotation=70, ha="right", fontsize=7)
    axes.set_yticks(range(len(rows)), [f"block {r}" if r != OUTSIDE else r for r in rows], fontsize=8)
    for i in range(len(rows)):  # mark the deviating cells
        for j in range(len(columns)):
            if np.isfinite(grid[i, j]) and grid[i, j] > 0:
                axes.text(j, i, "x", ha="center", va="center", fontsize=7, color="black")
    axes.set_title(f"{name}: fingerprints at step {step} (x: deviates; colour: log10 of the difference in units "
                   "of the allowed one)", fontsize=9)
    figure.colorbar(image, ax=axes, label="log10 score (> 0 deviates)")
    figure.savefig(path)
