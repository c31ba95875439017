"""[[sweeps]]: a grid of trainer option values, expanded into one test set per point.

    [[sweeps]]
    name = "lr"
    kind = "technique"
    grid = { "optimizer.lr" = [1e-3, 2e-3], "optimizer.weight_decay" = [0.0, 0.1] }

is four sets, "lr lr=0.001 weight_decay=0.0", ... in the grid's order (the last key varies
fastest), each with those values among its overrides (over the sweep's own `overrides`) and the
sweep's other keys (kind, degrees, expect). The sets are then read and checked as [[sets]] tables
are; a problem shared by every point is reported once.
"""

from __future__ import annotations

import itertools
from typing import Any

from protocol.schema import SWEEP_KEYS, read_table


def point_name(prefix: str, point: dict[str, Any]) -> str:
    return " ".join([prefix, *(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point.items())])


def expand_sweeps(data: Any, problems: list[str]) -> list[tuple[str, dict, list[str]]]:
    """(where, set table, the swept keys) of every point of every sweep, in order."""
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        problems.append("sweeps: expected an array of tables ([[sweeps]])")
        return []
    tables = []
    for index, sweep in enumerate(data):
        where = f"sweeps[{index}]"
        values = read_table({k: v for k, v in sweep.items() if k in ("name", "grid")}, {
            key: SWEEP_KEYS[key] for key in ("name", "grid")}, where, problems)
        grid = values.get("grid")
        if grid is None or "name" not in values:
            continue
        axes = _axes(grid, where, problems)
        if axes is None:
            continue
        common = {k: v for k, v in sweep.items() if k not in ("name", "grid")}
        for combination in itertools.product(*axes.values()):
            point = dict(zip(axes, combination))
            overrides = {**common.get("overrides", {}), **point} if isinstance(common.get("overrides", {}), dict) \
                else common.get("overrides")
            tables.append((where, {**common, "name": point_name(values["name"], point), "overrides": overrides},
                           list(point)))
    return tables


def _axes(grid: dict, where: str, problems: list[str]) -> dict[str, list] | None:
    """The grid's keys and their values; None (with the problems) when it is not a grid."""
    if not grid:
        problems.append(f"{where}.grid: empty; give each swept option its values: {{ \"optimizer.lr\" = [1e-3, 2e-3] }}")
        return None
    bad = [key for key, values in grid.items() if not isinstance(values, list) or not values]
    for key in bad:
        problems.append(f"{where}.grid.{key}: expected a non-empty array of values, got {grid[key]!r}")
    return None if bad else {key: list(values) for key, values in grid.items()}
