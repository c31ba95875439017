"""[[sweeps]]: a grid of trainer option values, or an ordered list of points, expanded into one
test set per point.

    [[sweeps]]
    name = "lr"
    kind = "technique"
    grid = { "optimizer.lr" = [1e-3, 2e-3], "optimizer.weight_decay" = [0.0, 0.1] }

is four sets, "lr lr=0.001 weight_decay=0.0", ... in the grid's order (the last key varies
fastest), each with those values among its overrides (over the sweep's own `overrides`) and the
sweep's other keys (kind, degrees, expect). The sets are then read and checked as [[sets]] tables
are; a problem shared by every point is reported once.

Points that are not a product of values (one option used only with some value of another) are an
ordered list instead of a grid:

    points = [{ "a.mode" = "full" }, { "a.mode" = "grouped", "a.group" = 2 }, ...]

A point may name itself (`{ name = "grouped 2", "a.mode" = "grouped", "a.group" = 2 }`: the set
is "<sweep> grouped 2"); trainer options always have a dot, so `name` cannot be one.

`search = "bisect"` makes the sweep a search over its points in the written order (most
communication first; protocol.plan.search, protocol.run.searches): only the points the bisection needs are run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from protocol.plan.schema import SEARCHES, SWEEP_KEYS, check_choice, flatten, read_table

OWN_KEYS = ("name", "grid", "points", "search")  # the sweep's own keys; the others are its sets'
MAX_POINTS = 1000


@dataclass(frozen=True)
class Sweep:
    """A sweep as the plan holds it: its sets' names in order, and whether it is searched."""

    name: str
    where: str
    points: tuple[str, ...]
    search: str | None = None


@dataclass(frozen=True)
class Point:
    """One set of a sweep: its table (read like a [[sets]] table), and where each swept option
    was written, for messages (`sweeps[0].grid."optimizer.lr"`)."""

    where: str
    table: dict
    written: dict[str, str]
    sweep: str


def point_name(prefix: str, point: dict[str, Any]) -> str:
    return " ".join([prefix, *(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point.items())])


def expand_sweeps(data: Any, problems: list[str]) -> tuple[list[Point], list[Sweep]]:
    """Every point of every sweep, in order, and the sweeps."""
    if data is None:
        return [], []
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        problems.append("sweeps: expected an array of tables ([[sweeps]])")
        return [], []
    points: list[Point] = []
    sweeps: list[Sweep] = []
    for index, sweep in enumerate(data):
        where = f"sweeps[{index}]"
        values = read_table({k: v for k, v in sweep.items() if k in OWN_KEYS},
                            {key: SWEEP_KEYS[key] for key in OWN_KEYS}, where, problems)
        check_choice(values, "search", SEARCHES, where, problems)
        found = sweep_points(values, where, problems)
        if found is None or "name" not in values:
            continue
        common = {k: v for k, v in sweep.items() if k not in OWN_KEYS}
        shared = common.get("overrides", {})
        named = []
        for point, written, label in found:
            overrides = {**shared, **point} if isinstance(shared, dict) else shared
            name = f"{values['name']} {label}" if label else point_name(values["name"], point)
            points.append(Point(where, {**common, "name": name, "overrides": overrides}, written, values["name"]))
            named.append(name)
        if search_problem(values, found, common, where, problems):
            continue
        sweeps.append(Sweep(values["name"], where, tuple(named), values.get("search")))
    return points, sweeps


def sweep_points(values: dict, where: str, problems: list[str]) -> list[tuple[dict, dict[str, str], str | None]] | None:
    """(options, where each was written, its own name or None) of every point of a grid or a
    points list; None (with the problems) when the sweep has neither, or both."""
    grid, listed = values.get("grid"), values.get("points")
    if grid is not None and listed is not None:
        problems.append(f"{where}: give grid (every combination of values) or points (an ordered list), not both")
        return None
    if grid is not None:
        axes = _axes(grid, where, problems)
        if axes is None:
            return None
        count = math.prod(len(values) for values in axes.values())
        if count > MAX_POINTS:  # each is a run: a mistake, and expanding it would take as long
            problems.append(f"{where}.grid: {count} combinations of values; a sweep has at most {MAX_POINTS} points")
            return None
        written = {key: f'{where}.grid."{key}"' for key in axes}
        return [(dict(zip(axes, combination)), written, None) for combination in itertools.product(*axes.values())]
    if listed is not None:
        return _listed(listed, where, problems)
    if "grid" not in values and "points" not in values:
        problems.append(f"{where}.grid: missing: give a grid of values ({{ \"optimizer.lr\" = [1e-3, 2e-3] }}) or "
                        "points, an ordered array of tables of trainer options")
    return None


def _axes(grid: dict, where: str, problems: list[str]) -> dict[str, list] | None:
    """The grid's keys and their values; None (with the problems) when it is not a grid."""
    if not grid:
        problems.append(f"{where}.grid: empty; give each swept option its values: {{ \"optimizer.lr\" = [1e-3, 2e-3] }}")
        return None
    bad = [key for key, values in grid.items() if not isinstance(values, list) or not values]
    for key in bad:
        problems.append(f"{where}.grid.{key}: expected a non-empty array of values, got {grid[key]!r}")
    return None if bad else {key: list(values) for key, values in grid.items()}


def _listed(listed: list[dict], where: str, problems: list[str]) -> list[tuple[dict, dict[str, str], str | None]] | None:
    if not listed:
        problems.append(f"{where}.points: empty; give one table of trainer options per point: "
                        "[{ \"optimizer.lr\" = 1e-3 }, { \"optimizer.lr\" = 2e-3 }]")
        return None
    empty = [i for i, point in enumerate(listed) if not point]
    for i in empty:
        problems.append(f"{where}.points[{i}]: empty; give the trainer options of this point")
    if empty:
        return None
    found = []
    for i, point in enumerate(listed):
        label = point.get("name")
        if label is not None and (not isinstance(label, str) or not label.strip()):
            problems.append(f"{where}.points[{i}].name: expected a non-empty string, got {label!r}")
            return None
        options = flatten({key: value for key, value in point.items() if key != "name"})
        found.append((options, {key: f'{where}.points[{i}]."{key}"' for key in options}, label))
    return found


def search_problem(values: dict, found: list, common: dict, where: str, problems: list[str]) -> bool:
    """A bisection needs one ordered axis, and points it can judge by the criterion (positive
    controls are judged the other way round)."""
    if values.get("search") is None:
        return False
    if "grid" in values and len(values["grid"]) > 1:
        problems.append(f"{where}.search: a bisection needs one ordered axis, but the grid has "
                        f"{len(values['grid'])} keys; give a grid of one key, or points in order (most communication "
                        "first)")
        return True
    if common.get("expect") == "fail":
        problems.append(f"{where}.expect: a searched sweep's points are judged by the criterion, which they should "
                        "meet; remove expect = 'fail'")
        return True
    return False
