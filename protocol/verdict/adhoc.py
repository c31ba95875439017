"""`protocol compare --control DIR [--noise DIR ...] --test NAME=DIR ...`: folders compared without
running a plan (runs made by hand, or curves of another trainer).

A paired comparison is only meaningful between runs that trained on the same data, from the same
weights, for the same number of steps. Where the folders hold this trainer's run records, those
are checked first and runs that differ are refused (one message naming each difference), so a
verdict never rests on runs that could not be paired. Folders without a record (another
trainer's curves, a bare metrics.jsonl) cannot be checked; the report says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.plan.records import read_record
from protocol.plan.tolerance import Tolerance
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve
from protocol.verdict.results import Comparison
from protocol.verdict.run_info import RunInfo, first_start, run_info

Reader = Callable[[Path, str | None], Curve]


class PairingError(ValueError):
    """Runs that cannot be compared as asked (different data, start or steps; too few controls)."""


@dataclass
class FolderComparison:
    comparison: Comparison
    family: list[Curve]
    tests: list[Curve]
    layouts: dict[str, str] = field(default_factory=dict)
    runs: list[RunInfo] = field(default_factory=list)


def folder_of(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def compare_folders(controls: Sequence[Path], noise: Sequence[Path], tests: Sequence[tuple[Path, str | None]],
                    tolerance: Tolerance, unpaired: bool, reader: Reader) -> FolderComparison:
    """Read, check and judge; raises PairingError for runs that cannot be compared as asked."""
    check_counts(len(controls), len(noise), tolerance, unpaired)
    family_paths = [*controls, *noise]
    family = [reader(path, None) for path in family_paths]
    test_curves = [reader(path, name) for path, name in tests]
    paths = {curve.name: path for curve, path in zip([*family, *test_curves], [*family_paths, *(p for p, _ in tests)])}
    if len(paths) < len(family) + len(test_curves):
        raise PairingError("two of the folders give runs of the same name; name the tests with --test NAME=PATH")
    records = {name: read_record(folder_of(path)) for name, path in paths.items()}
    problems = pairing_problems(records, family[0].name, unpaired)
    if problems:
        raise PairingError("these runs cannot be compared with the control " + repr(family[0].name) + ":\n  "
                           + "\n  ".join(problems))
    warnings = unchecked(records)
    if tolerance.mode == "statistical" and not unpaired and len(noise) != tolerance.noise_controls:
        warnings.append(f"{len(noise)} noise controls given where the tolerance asks for {tolerance.noise_controls}: "
                        "the noise is measured from fewer or more runs than planned (the report's false-fail chance "
                        "is that of the runs given)")
    if tolerance.mode == "exact":
        from protocol.verdict.gather import numerics_warnings

        runs = [run_info(n, folder_of(p), records[n], records[family[0].name]) for n, p in paths.items()]
        warnings += numerics_warnings(runs)
    comparison = compare(family, test_curves, tolerance, design="unpaired" if unpaired else None, warnings=warnings)
    control_record = records[family[0].name]
    runs = [run_info(name, folder_of(path), records[name], control_record) for name, path in paths.items()]
    layouts = {run.name: run.layout for run in runs if run.recorded}
    return FolderComparison(comparison, family, test_curves, layouts, runs)


def check_counts(controls: int, noise: int, tolerance: Tolerance, unpaired: bool) -> None:
    if tolerance.mode == "exact":
        if noise or unpaired or controls > 1:
            raise PairingError("exact mode compares every step with one control: give one --control, no --noise and "
                               "no --unpaired (those are for mode statistical)")
        return
    if unpaired:
        if noise:
            raise PairingError("--unpaired judges against the spread of the --control repeats; --noise is for paired "
                               "runs")
        if controls < 3:
            raise PairingError(f"--unpaired needs at least 3 --control repeats to measure their spread, got {controls}")
        return
    if controls != 1:
        raise PairingError(f"paired statistical mode takes one --control and its noise controls (--noise, at least 2); "
                           f"got {controls} --control (for seed repeats of another trainer use --unpaired)")
    if noise < 2:
        raise PairingError(f"statistical mode measures the noise with the control's noise controls: give at least 2 "
                           f"--noise folders (runs on the same data from the same weights, perturbed by "
                           f"--debug.init_perturbation), got {noise}; or use --unpaired with seed repeats")


def pairing_problems(records: dict[str, dict | None], control: str, unpaired: bool) -> list[str]:
    """Each recorded run that started elsewhere, trained on other data or for another number of
    steps than the control (unpaired runs differ in data and start by design: steps only)."""
    reference = records.get(control)
    if reference is None:
        return []
    problems = []
    for name, record in records.items():
        if record is None or name == control:
            continue
        for what, value in identity(record, unpaired).items():
            expected = identity(reference, unpaired)[what]
            if value != expected:
                problems.append(f"{name}: {what} {describe(value)}, the control's {describe(expected)}")
    return problems


def identity(record: dict, unpaired: bool) -> dict:
    """What paired runs must share: the checkpoint they started from, the data, the step count."""
    steps = ((record.get("config") or {}).get("training") or {}).get("steps")
    if unpaired:
        return {"steps": steps}
    start = first_start(record).get("start") or {}
    return {"seed checkpoint": start.get("fingerprint"), "data": record.get("data"), "steps": steps}


def describe(value) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:8]
    return "none" if value is None else str(value)


def unchecked(records: dict[str, dict | None]) -> list[str]:
    missing = [name for name, record in records.items() if record is None]
    if not missing:
        return []
    return [f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no run record (run_meta.json), so "
            "whether they trained on the control's data from its weights for its steps was not checked"]
