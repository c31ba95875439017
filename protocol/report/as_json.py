"""report.json: every field of a `Comparison` (per-step differences and per-observable verdicts
included) as strict JSON, and back.

Non-finite numbers are written as the strings "nan", "inf", "-inf" so that strict JSON readers
accept the file; `comparison_from_dict` turns them back into floats. The report's own additions
(`layouts`, `runs`, `performance`, and in statistical mode `findings`, each set's
`set_false_fail` and each observable's `noise_ratio`, `bound_sigmas` and `diff_sigmas`) are left
out of the round trip, and so are the fingerprint localizations (`fingerprints`: set name -> first
step, causes, summary; protocol.verdict.fingerprints.as_dict): they follow from the fields (protocol.report.findings, protocol.verdict.family_wise).

The statistical verdict's numbers are fields, so they are written as they are: per observable
`bound` (the |D| it fails from, as applied), `p_value`, `holm_threshold`, `family_noise_sd`,
`chance_fail` (and `noise_ratio`, a property, added by report_extras); per set `skipped_steps`;
the comparison's `plan_false_fail` and `family_skips`; per noise summary `plan_mde`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
import typing
from typing import Any

from protocol.plan.tolerance import Tolerance
from protocol.verdict.decision import ObservableVerdict
from protocol.verdict.family_wise import set_false_fail
from protocol.verdict.fingerprints import as_dict
from protocol.verdict.results import Comparison, NoiseSummary, NotCompared, SetResult

REPORT_EXTRAS = ("layouts", "runs", "performance", "status_line", "findings")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def comparison_to_dict(comparison: Comparison) -> dict:
    """Every field of the comparison as strict-JSON-ready data, plus `passed` for readers that
    only want the yes or no."""
    data = encode(dataclasses.asdict(replace(comparison, fingerprints={})))
    data["fingerprints"] = {name: encode(as_dict(where)) for name, where in comparison.fingerprints.items()}
    data["passed"] = comparison.passed
    for result, item in zip(comparison.results, data["results"]):
        item["outcome"] = result.outcome
    return data


def report_extras(data: dict, comparison: Comparison, findings: dict) -> None:
    """Statistical mode's derived numbers, added to `data` (comparison_to_dict's) in place: each
    set's false-fail bound, each observable's noise ratio and its bound and |D| in noise SDs, the
    findings."""
    for result, item in zip(comparison.results, data["results"]):
        item["set_false_fail"] = set_false_fail(result.observables)
        for verdict, observable in zip(result.observables, item["observables"]):
            sd = verdict.noise_sd
            observable["bound_sigmas"] = encode(verdict.bound / sd if sd > 0 else math.nan)
            observable["diff_sigmas"] = encode(abs(verdict.diff) / sd if sd > 0 else math.nan)
            observable["noise_ratio"] = verdict.noise_ratio
    data["findings"] = encode(findings)


def _floats(value: Any) -> Any:
    """"nan"/"inf" strings back to floats, inside lists too."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def _build(cls, data: dict):
    """A dataclass from its asdict() form; float fields (and lists of floats) decoded."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in names:
            continue
        values[key] = _floats(value) if "float" in str(hints[key]) else value
    return cls(**values)


def comparison_from_dict(data: dict) -> Comparison:
    """The inverse of `comparison_to_dict` (e.g. for a report.json read back)."""
    results = []
    for item in data["results"]:
        result = _build(SetResult, item)
        result.observables = [_build(ObservableVerdict, o) for o in item.get("observables", [])]
        results.append(result)
    noise = []
    for item in data.get("noise", []):
        summary = _build(NoiseSummary, item)
        summary.growth = [tuple(point) for point in summary.growth]
        summary.member_diffs = {k: _floats(v) for k, v in summary.member_diffs.items()}
        noise.append(summary)
    tolerance = dict(data["tolerance"])
    tolerance["observables"] = tuple(tolerance.get("observables", ()))
    skip = ("results", "tolerance", "not_compared", "noise", "passed", "fingerprints") + REPORT_EXTRAS
    fields = {k: v for k, v in data.items() if k not in skip}
    return Comparison(tolerance=Tolerance(**tolerance), results=results, noise=noise,
                      not_compared=[NotCompared(**m) for m in data.get("not_compared", [])], **fields)
