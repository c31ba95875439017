"""What a statistical report points out besides the verdicts: findings that fail nothing but are
worth a look, and a caveat on timings.

* correct sets that lean the same way: every passing set's final-window difference of an
  observable has one sign and their mean is beyond LEAN_SIGMAS noise SDs. Each set is within its
  bound, but a shared offset points at a shared cause (the layouts reduce alike) or at the control
  family's mean being off by chance (every set is measured against it, so it moves them alike);
* a set noisier than its controls (its own noise raised its noise SD above the family's by
  SAY_NOISIER or more: ObservableVerdict.noise_ratio), which is judged by that larger noise and
  so detects less;
* float16 steps skipped for an overflow, per run (left out of every comparison);
* learning rates that differ from the control family's; differences below float rounding
  (LR_ROUNDING, relative) are none: a mean of identical rates can differ from them by 1e-16;
* timings from identical runs (the control family) that differ by more than TIMING_SPREAD: the
  runs shared a machine, so no run's speed can be compared with another's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from protocol.report.formats import fmt_diff
from protocol.verdict.decision import SAY_NOISIER
from protocol.verdict.results import Comparison

LEAN_SIGMAS = 1.0
LR_ROUNDING = 1e-12
TIMING_SPREAD = 1.5
TIMINGS = (("step_time_s", "step time", "s"), ("tokens_per_s", "tokens/s", ""))


@dataclass
class Lean:
    """Passing sets whose final-window differences of `observable` share a sign."""

    observable: str
    diffs: dict[str, float]
    mean: float
    noise_sd: float
    """The control family's noise SD of one set's difference."""

    @property
    def sigmas(self) -> float:
        return self.mean / self.noise_sd


@dataclass
class Noisier:
    set: str
    observable: str
    noise_ratio: float
    noise_sd: float
    family_noise_sd: float


@dataclass
class Findings:
    leans: list[Lean]
    noisier: list[Noisier]
    skips: dict[str, int]
    """float16 overflow skips per run (the control family first), empty when no run skipped."""
    lr_differs: dict[str, float]
    """Sets whose learning rate differs from the family's by more than float rounding (relative)."""
    timing_caveat: str | None

    def to_dict(self) -> dict:
        data = asdict(self)
        for lean, item in zip(self.leans, data["leans"]):
            item["sigmas"] = lean.sigmas
        return data


def findings(comparison: Comparison, figures: Mapping[str, Mapping[str, float | None]] | None = None) -> Findings:
    return Findings(leans=leans(comparison), noisier=noisier(comparison), skips=skip_counts(comparison),
                    lr_differs=lr_differences(comparison),
                    timing_caveat=timing_caveat(figures or {}, comparison.controls))


def family_noise_sd(comparison: Comparison, observable: str, fallback: float) -> float:
    summary = next((n for n in comparison.noise if n.observable == observable), None)
    return summary.noise_sd if summary is not None else fallback


def leans(comparison: Comparison) -> list[Lean]:
    """Per observable: two or more passing correct sets, one sign, a mean beyond LEAN_SIGMAS."""
    found = []
    for observable in comparison.tolerance.observables:
        verdicts = [(r.name, v) for r in comparison.results if r.expect == "pass" and not r.failed
                    for v in r.observables if v.observable == observable]
        if len(verdicts) < 2:
            continue
        diffs = {name: v.diff for name, v in verdicts}
        signs = {math.copysign(1.0, d) for d in diffs.values() if d != 0}
        if len(signs) != 1 or 0 in diffs.values():
            continue
        sd = family_noise_sd(comparison, observable, verdicts[0][1].family_noise_sd)
        mean = float(np.mean(list(diffs.values())))
        if sd > 0 and abs(mean) > LEAN_SIGMAS * sd:
            found.append(Lean(observable, diffs, mean, sd))
    return found


def noisier(comparison: Comparison) -> list[Noisier]:
    return [Noisier(r.name, v.observable, v.noise_ratio, v.noise_sd, v.family_noise_sd)
            for r in comparison.results for v in r.observables if v.noise_ratio >= SAY_NOISIER]


def skip_counts(comparison: Comparison) -> dict[str, int]:
    counts = {**comparison.family_skips, **{r.name: r.skipped_steps for r in comparison.results}}
    return counts if any(counts.values()) else {}


def lr_differences(comparison: Comparison) -> dict[str, float]:
    return {r.name: r.lr_max_rel_diff for r in comparison.results
            if r.lr_max_rel_diff is not None and not r.lr_max_rel_diff < LR_ROUNDING}


def lr_cell(value: float | None) -> str:
    """A set's largest relative learning-rate difference, 'equal' below float rounding."""
    if value is None:
        return "-"
    return "equal" if value < LR_ROUNDING else fmt_diff(value)


def timing_caveat(figures: Mapping[str, Mapping[str, float | None]], controls: list[str]) -> str | None:
    """The control family's runs are identical: timings that differ between them by more than
    TIMING_SPREAD came from the machine (other work, another node), not from the runs."""
    spreads = []
    for key, label, unit in TIMINGS:
        values = [figures[name][key] for name in controls if name in figures and figures[name].get(key)]
        if len(values) >= 2 and max(values) > TIMING_SPREAD * min(values):
            spreads.append(f"{label} {max(values) / min(values):.1f}x ({min(values):.4g}-{max(values):.4g}"
                           f"{' ' + unit if unit else ''})")
    if not spreads:
        return None
    return (f"the control family's runs are identical, yet differ in {' and '.join(spreads)}: the runs shared a "
            "machine with other work (or ran on different ones), so these timings are not comparable between runs; "
            "run them alone to compare speed.")


def markdown(found: Findings) -> list[str]:
    """The "## Findings" section ([] when there is nothing to say)."""
    items = [lean_line(lean) for lean in found.leans]
    items += [f"{n.set} is noisier than its controls: its own noise raised its {n.observable} noise SD "
              f"{n.noise_ratio:.2f}x, to {fmt_diff(n.noise_sd)} from the family's {fmt_diff(n.family_noise_sd)}; "
              "it was judged by the larger, so it detects less." for n in found.noisier]
    if found.skips:
        counts = ", ".join(f"{name} {count}" for name, count in found.skips.items())
        items.append(f"float16 steps skipped for an overflow (left out of every comparison): {counts}.")
    if found.lr_differs:
        items.append("learning rate differs from the control family's (largest relative difference): "
                     + ", ".join(f"{name} {fmt_diff(v)}" for name, v in found.lr_differs.items())
                     + "; the other sets' equal it within float rounding.")
    if not items:
        return []
    return ["## Findings", "", "Not failures; worth a look.", "", *[f"- {item}" for item in items], ""]


def lean_line(lean: Lean) -> str:
    sets = ", ".join(f"{name} {fmt_diff(d, signed=True)} ({d / lean.noise_sd:+.1f} noise SD)"
                     for name, d in lean.diffs.items())
    side = "above" if lean.mean > 0 else "below"
    mean = fmt_diff(lean.mean, signed=True)
    return (f"correct sets lean the same way in {lean.observable}: {sets}; their mean {mean} "
            f"is {abs(lean.sigmas):.1f} noise SDs {side} the control family's. Not a failure (each is within its "
            "bound), but worth a look: a cause the sets share, or the family's mean off by chance (every set is "
            "measured against it, so it moves them all alike).")
