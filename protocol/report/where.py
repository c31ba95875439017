"""The report's answer to *where* each set parts from the control: one line per set from its
fingerprints (protocol.verdict.fingerprints), and a heat map (protocol.report.fingerprint_map)
for each set that parts, at its first deviating step."""

from __future__ import annotations

from pathlib import Path

from protocol.plan.model import slugify
from protocol.verdict.fingerprint_noise import FALSE_FAIL, FLOOR
from protocol.verdict.fingerprints import EXACT_TOLERANCE
from protocol.verdict.results import Comparison

MAP_PREFIX = "fingerprints-"


def map_name(set_name: str) -> str:
    return f"{MAP_PREFIX}{slugify(set_name)}.png"


def where_section(comparison: Comparison) -> list[str]:
    """report.md's "Where" section; nothing when no run recorded fingerprints."""
    found = comparison.fingerprints
    if not found:
        return []
    if comparison.mode == "exact":
        rule = f"an entry deviates beyond {EXACT_TOLERANCE:.0e} relative (correct float32 layouts stay within 3.3e-6)"
    else:
        values = [t for w in found.values() for t in w.thresholds.values()]
        rule = ("an entry deviates beyond its own rounding noise at that step (the control family's relative spread, "
                f"per entry) times a threshold ({min(values):.2f}-{max(values):.2f} here, by the degrees of freedom of "
                f"each quantity's noise) at which a plan of correct sets fails on its fingerprints with probability "
                f"{FALSE_FAIL:.0%} (family-wise over every entry of every recorded step of every set), and by at least "
                f"{FLOOR:.0e} relative; such a set fails" if values else "")
    lines = ["## Where the sets part from the control (fingerprints)", "",
             "Per-parameter gradient, update and weight norms and per-block output and gradient RMS, compared with "
             f"the control's from step 1: {rule}. The first such step is named, with its deviating modules "
             "(the layer index replaced by `*`), those whose deviation follows from another's counted apart.", ""]
    for name, where in found.items():
        role = (" (fingerprints = \"localize\": a technique that changes the numbers on purpose, judged by its curves; "
                "this says where, and fails nothing)" if name in comparison.localize_only else "")
        lines.append(f"- **{name}**{role}: {where.summary()}")
        if where.first_step is not None:
            lines.append(f"  ![{name}]({map_name(name)})")
    return lines + [""]


def write_fingerprint_maps(comparison: Comparison, out: Path) -> dict[str, Path]:
    """A heat map per set that parts from the control; older maps of this report folder go."""
    from protocol.report.fingerprint_map import draw_fingerprint_map

    for old in out.glob(f"{MAP_PREFIX}*.png"):
        old.unlink()
    written = {}
    for name, where in comparison.fingerprints.items():
        if where.first_step is not None:
            path = out / map_name(name)
            draw_fingerprint_map(name, where.first_step, where.scores, path)
            written[f"fingerprints {name}"] = path
    return written
