"""How a test set is judged against the control: the `[tolerance]` table of a plan.

`exact` fits deterministic fp32 runs from one seed checkpoint: every step's loss must stay within
`loss_atol` of the control's and every step's gradient norm within `grad_norm_rtol` of it.
`statistical` fits runs that differ by rounding (bf16, non-deterministic kernels, long runs):
every run trains on the same data from the same weights, `noise_controls` repeats of the control
differ from it only by a rounding-level perturbation of the weights, and each observable of a set
is judged by the rule in protocol.verdict.decision against the noise those repeats measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

MODES = ("exact", "statistical")
# What a statistical verdict can judge: per-step outcomes of training, as metrics.jsonl logs them.
# The learning rate is an input (the schedule), compared as configuration, not judged.
OBSERVABLES = ("loss", "grad_norm")
# More noise controls than this would only be a mistake (a plan of thousands of runs of the control).
MAX_NOISE_CONTROLS = 100
# Keys of earlier versions, and what replaced them: a plan that still has them gets this hint.
REPLACED = {
    "control_repeats": "noise_controls (repeats of the control that differ only in rounding; every run now trains "
                       "on the same data)",
    "relative_floor": "margin_sigmas, or an explicit loss_margin",
    "noise_multiplier": "margin_sigmas",
    "trend_z": "alpha (the drift test's level)",
}


@dataclass(frozen=True)
class Tolerance:
    mode: str = "exact"
    """`exact` (every step within a tolerance) or `statistical` (paired equivalence and drift tests
    against noise controls, protocol.verdict.decision)."""

    loss_atol: float = 1e-4
    """exact: largest |test loss - control loss| allowed at any step."""

    grad_norm_rtol: float = 1e-5
    """exact: largest relative grad-norm difference allowed at any step; 0 reports it without judging."""

    noise_controls: int = 4
    """statistical: repeats of the control on the same data from the same seed checkpoint, each
    with its weights perturbed at rounding level (debug.init_perturbation, seeds 1, 2, ...); with
    the control they measure how far runs drift apart by rounding alone. At least 2."""

    perturbation: float = 1.0
    """statistical: the noise controls' debug.init_perturbation, in rounding errors of the compute
    dtype (1: up to half a bf16 unit in the last place)."""

    observables: tuple[str, ...] = field(default=OBSERVABLES)
    """statistical: what is judged, each paired step by step with the control: "loss" (nats) and
    "grad_norm" (as log, so its differences are relative)."""

    alpha: float = 0.05
    """statistical: level of the equivalence test (one-sided, each side) and of the drift test."""

    margin_sigmas: float = 5.0
    """statistical: the equivalence margin, in standard deviations of a correct set's final-window
    difference as the noise controls measure it (used when no explicit margin is given)."""

    loss_margin: float = 0.0
    """statistical: an explicit margin for the loss's final-window difference, in nats; 0 derives
    it from the noise controls (margin_sigmas)."""

    grad_norm_margin: float = 0.0
    """statistical: an explicit margin for log(grad norm)'s final-window difference (about a
    relative difference); 0 derives it from the noise controls."""

    final_window: float = 0.1
    """Fraction of the last logged steps whose mean difference is judged (and reported in both modes)."""

    power: float = 0.8
    """statistical: the probability of failing at which the report states the minimum detectable effect."""

    plan_false_fail: float = 0.05
    """statistical: the largest chance that a plan whose sets are all correct fails anywhere by
    chance; Holm's step-down over every (set, observable) of the plan keeps it there
    (protocol.verdict.family_wise)."""

    def margin(self, observable: str) -> float:
        """The explicit margin of an observable; 0 means derived from the noise controls."""
        return {"loss": self.loss_margin, "grad_norm": self.grad_norm_margin}.get(observable, 0.0)

    def problems(self) -> list[str]:
        """Every invalid setting, each naming its key and what would be valid."""
        found = []
        if self.mode not in MODES:
            found.append(f"tolerance.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        for key in ("loss_atol", "margin_sigmas", "perturbation"):
            if getattr(self, key) <= 0:
                found.append(f"tolerance.{key}: must be > 0, got {getattr(self, key)}")
        for key in ("grad_norm_rtol", "loss_margin", "grad_norm_margin"):
            if getattr(self, key) < 0:
                found.append(f"tolerance.{key}: must be >= 0 (0 = {'not judged' if key == 'grad_norm_rtol' else 'derived'})"
                             f", got {getattr(self, key)}")
        for key in ("final_window",):
            if not 0 < getattr(self, key) <= 1:
                found.append(f"tolerance.{key}: a fraction in (0, 1], got {getattr(self, key)}")
        for key in ("alpha", "power", "plan_false_fail"):
            if not 0 < getattr(self, key) < 1:
                found.append(f"tolerance.{key}: a probability in (0, 1), got {getattr(self, key)}")
        if self.noise_controls < 2:
            found.append(f"tolerance.noise_controls: the noise is measured by the spread of the control and its noise "
                         f"controls; give at least 2, got {self.noise_controls}")
        elif self.noise_controls > MAX_NOISE_CONTROLS:
            found.append(f"tolerance.noise_controls: each is a run of the control; give at most {MAX_NOISE_CONTROLS}, "
                         f"got {self.noise_controls}")
        unknown = [o for o in self.observables if o not in OBSERVABLES]
        if unknown or not self.observables:
            found.append(f"tolerance.observables: {list(self.observables)!r}: choose one or more of "
                         f"{', '.join(map(repr, OBSERVABLES))}")
        return found


def tolerance_keys() -> dict[str, type]:
    """Every [tolerance] key with the type a plan must give it."""
    return {f.name: (list if f.name == "observables" else type(f.default)) for f in fields(Tolerance)}
