"""Number and table formats shared by report.md's sections (protocol.report.markdown and the statistical
sections in protocol.report.statistical, protocol.report.findings)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt_loss(value: float | None) -> str:
    """A loss value: 6 significant digits."""
    if value is None:
        return "-"
    return f"{value:.6g}"


def fmt_diff(value: float | None, signed: bool = False) -> str:
    """A difference: scientific notation so that 2.4e-07 and 3.1e-02 stay comparable at a glance."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:+.2e}" if signed else f"{value:.2e}"


def fmt_p(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2g}"


def fmt_sigmas(value: float, noise_sd: float, signed: bool = False) -> str:
    """`value` in noise SDs, one decimal ('-' without a noise SD to count in)."""
    if not (noise_sd > 0 and math.isfinite(value)):
        return "-"
    return f"{value / noise_sd:+.1f}" if signed else f"{value / noise_sd:.1f}"


def fmt_share(value: float | None) -> str:
    """A probability as a percentage: 1.9%, 0.03%."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.1%}" if value >= 0.001 else f"{value * 100:.2g}%"


def markdown_table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731 - a set name may contain a pipe
    lines = ["| " + " | ".join(escape(c) for c in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return lines
