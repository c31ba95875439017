"""What a comparison returns: the per-set numbers and verdicts, the runs that could not be
compared, the control family's noise and the plan's verdict (protocol.verdict.compare fills them in)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.plan.tolerance import Tolerance
from protocol.verdict.decision import ObservableVerdict

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
DESIGNS = ("exact", "paired", "unpaired")


@dataclass
class SetResult:
    """Numbers and verdict of one test set. The loss figures compare it with the reference: the
    control (exact mode) or the control family's mean (statistical)."""

    name: str
    expect: str
    """"pass", or "fail" for a positive control."""
    steps_compared: int
    missing_in_test: list[int]
    missing_in_control: list[int]
    initial_loss: float
    final_loss: float
    control_initial_loss: float
    control_final_loss: float
    max_abs_diff: float
    max_abs_diff_step: int | None
    mean_abs_diff: float
    final_diff: float
    final_window_diff: float
    grad_norm_max_rel_diff: float | None
    grad_norm_first_rel_diff: float | None
    """At the first common step (step 1 for a full run): the earliest sign of a wrong gradient."""
    lr_max_rel_diff: float | None
    """Largest relative learning-rate difference: the schedule, which a layout must not change."""
    first_diverging_step: int | None
    """exact: first step beyond loss_atol; statistical: first step a failing observable leaves the
    noise envelope for good. None for a passing set."""
    observables: list[ObservableVerdict] = field(default_factory=list)
    """statistical: one verdict per judged observable."""
    failed: bool = True
    reason: str = ""
    steps: list[int] = field(default_factory=list, repr=False)
    loss_diff: list[float] = field(default_factory=list, repr=False)
    """test - reference loss at each of `steps`."""
    grad_norm_diff: list[float] = field(default_factory=list, repr=False)
    """test / reference grad norm - 1 at each of `steps` (empty without grad norms)."""
    problems: list[str] = field(default_factory=list)
    """statistical: what failed the set besides its observables' verdicts (an observable that
    cannot be judged, far more float16 skips than the family)."""
    skipped_steps: int = 0
    """float16 steps its loss scaler skipped for an overflow."""
    evidence: list[str] = field(default_factory=list)
    """What failed it: "curves" (its judged observables, or a problem with them), "fingerprints"
    (they part from the control's, or its logged norm is not its gradients'), "own noise" (its
    curve far noisier than any noise control's); empty for a set that passed."""
    label: str = ""
    """The outcome in other words, when a [criterion] judged the set as a point of a sweep
    ("meets criterion" / "misses criterion": a measurement, not a pass or a failure)."""

    @property
    def verdict(self) -> bool:
        """True when the set passed its judgement (a positive control that passes is True too)."""
        return not self.failed

    @property
    def outcome(self) -> str:
        """PASS, FAIL, 'FAIL (expected)' for a positive control that failed, 'PASS (expected to
        fail)' for one that did not."""
        if self.label:
            return self.label
        if self.expect == "fail":
            return "FAIL (expected)" if self.failed else "PASS (expected to fail)"
        return FAIL if self.failed else PASS


@dataclass
class NotCompared:
    """A run of the plan that has no curve to judge: it failed, or never ran. It fails the plan."""

    name: str
    verdict: str
    """"FAILED" (it ran and failed), "NOT RUN" (skipped, or not run yet) or "STOPPED" (an early-stop
    rule ended it; the reason names the rule and the value that broke it)."""
    reason: str


@dataclass
class NoiseSummary:
    """What the control family says about rounding noise, per judged observable."""

    observable: str
    noise_sd: float
    """Standard deviation of a correct set's final-window difference."""
    margin: float
    mde: float
    """Minimum detectable final-window offset (see protocol.verdict.decision)."""
    mde_if_noisier: float
    """The same if the true noise SD were at the upper 95% bound of its estimate."""
    false_fail: float
    """At most the chance that a correct set fails this observable's equivalence test."""
    plan_mde: float
    """The offset detected with the tolerance's power under the plan-level bound at its strictest
    (protocol.verdict.family_wise): the detectable offset once every set of the plan is counted."""
    member_diffs: dict[str, float]
    """Each family member's final-window mean minus the family's."""
    growth: list[tuple[int, float]]
    """(step, RMS over noise controls of their paired difference from the control, averaged over
    the steps around it): how the rounding noise grows."""


@dataclass
class Comparison:
    """All test sets against one control."""

    control: str
    mode: str
    design: str
    """"exact", "paired" (statistical, every run on the same data) or "unpaired"."""
    tolerance: Tolerance
    results: list[SetResult]
    status: str
    """PASS, FAIL or INCONCLUSIVE."""
    controls: list[str] = field(default_factory=list)
    """The control family: the control, then its noise controls (or, unpaired, its repeats)."""
    noise: list[NoiseSummary] = field(default_factory=list)
    not_compared: list[NotCompared] = field(default_factory=list)
    note: str = ""
    """Why nothing was compared, when that is so (no control to compare against)."""
    warnings: list[str] = field(default_factory=list)
    family_skips: dict[str, int] = field(default_factory=dict)
    """float16: steps each member of the control family skipped for an overflow."""
    plan_false_fail: float | None = None
    """statistical: at most the chance that this plan, were every set correct, fails by chance
    (Holm's step-down over its judged observables, protocol.verdict.family_wise)."""
    criterion: str = ""
    """'criterion: validation/loss at step 20000 <= 1.02 x control (3.28 -> 3.3456)' when the plan's
    [criterion] judged the sets (protocol.verdict.by_criterion) instead of the tolerance."""
    status_text: str = ""
    """The verdict line, when the criterion wrote it."""
    fingerprints: dict = field(default_factory=dict)
    """Set name -> where it parts from the control (protocol.verdict.fingerprints.Localization),
    for the sets whose runs recorded fingerprints."""
    localize_only: list[str] = field(default_factory=list)
    """The sets whose fingerprints only say where they part (the plan's fingerprints = "localize")."""

    @property
    def passed(self) -> bool:
        return self.status == PASS
