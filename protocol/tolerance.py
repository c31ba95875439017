"""How a test set is judged against the control: the `[tolerance]` table of a plan.

`exact` fits runs that start from one seed checkpoint in deterministic mode: every step's loss must
stay within `loss_atol` of the control's. `statistical` fits runs whose curves differ by noise
(bf16, non-deterministic kernels, long runs): the control is repeated with `control_repeats`
seeds, their spread sets a noise band, and a set passes when its final-window mean loss lies
within that band of the control's and the difference shows no significant trend.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("exact", "statistical")


@dataclass(frozen=True)
class Tolerance:
    mode: str = "exact"
    """`exact` (per-step absolute tolerance) or `statistical` (equivalence within a noise band)."""

    loss_atol: float = 1e-4
    """exact: largest |test loss - control loss| allowed at any step."""

    grad_norm_rtol: float = 0.0
    """exact: largest relative grad-norm difference allowed at any step; 0 reports it without judging."""

    control_repeats: int = 3
    """statistical: how many times the control runs, each with another seed (debug.seed + i)."""

    relative_floor: float = 0.01
    """statistical: smallest band, as a fraction of the control's final-window mean loss."""

    noise_multiplier: float = 3.0
    """statistical: the band is max(relative_floor x control mean, noise_multiplier x seed spread)."""

    final_window: float = 0.1
    """Fraction of the last logged steps whose mean is compared (and reported in both modes)."""

    trend_z: float = 2.576
    """statistical: |slope / standard error| of the loss difference above which a trend is significant
    (2.576: two-sided 1%)."""

    def problems(self) -> list[str]:
        """Every invalid setting, each naming its key and what would be valid."""
        found = []
        if self.mode not in MODES:
            found.append(f"tolerance.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        for key in ("loss_atol", "relative_floor", "noise_multiplier", "trend_z"):
            if getattr(self, key) <= 0:
                found.append(f"tolerance.{key}: must be > 0, got {getattr(self, key)}")
        if self.grad_norm_rtol < 0:
            found.append(f"tolerance.grad_norm_rtol: must be >= 0 (0 = not judged), got {self.grad_norm_rtol}")
        if not 0 < self.final_window <= 1:
            found.append(f"tolerance.final_window: a fraction in (0, 1], got {self.final_window}")
        if self.mode == "statistical" and self.control_repeats < 2:
            found.append(f"tolerance.control_repeats: statistical mode needs >= 2 control runs to measure the "
                         f"seed spread, got {self.control_repeats}")
        return found
