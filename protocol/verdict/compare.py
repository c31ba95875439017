"""Test-set curves against the control: the per-set numbers and the plan's verdict.

* ``exact``: runs from one seed checkpoint in deterministic fp32 should agree step by step, so
  every common step's |loss difference| must stay within ``loss_atol`` and the relative
  grad-norm difference within ``grad_norm_rtol`` (when > 0), and the test must log every
  control step.
* ``statistical``: every judged observable of a set is paired step by step with the control
  family (the control and its noise controls, on identical data) and judged by the rule of
  protocol.verdict.decision: equivalence of the final-window mean within a margin, and no drift.

Where the runs recorded per-module fingerprints (metrics.fingerprints, on in protocol runs), each
set's are compared with the control's from step 1 (protocol.verdict.fingerprints): the report
says where a set parts from the control. A fingerprint beyond its tolerance (exact mode) or beyond
its own rounding noise times the plan's family-wise threshold (statistical mode), or a logged
gradient norm that is not the norm of the run's own gradients, fails the set. In statistical mode a
set whose curve is far noisier than any noise control's (OWN_NOISE_FAILS times the family's noise
SD) fails too: its own noise is evidence (but for a float16 set that skipped steps for an overflow,
whose missed updates explain it). Each failed set names the evidence that failed it
(SetResult.evidence): curves, fingerprints, own noise, or several.

Sets may be positive controls (``expect = "fail"``, e.g. a learning rate 5% off): they must fail.
One that passes shows that the plan could not have caught a bug of that size, and the plan is
INCONCLUSIVE rather than PASS. A set that fails where it should pass, or a run that failed,
makes it FAIL.
"""

from __future__ import annotations

import numpy as np

from protocol.plan.tolerance import Tolerance
from protocol.verdict.alignment import skipped_steps, summarize
from protocol.verdict.curves import Curve
from protocol.verdict.family_wise import apply_plan_level, set_false_fail
from protocol.verdict.fingerprints import EXACT_TOLERANCE, localize_sets
from protocol.verdict.results import FAIL, INCONCLUSIVE, PASS, Comparison, NotCompared, SetResult
from protocol.verdict.statistical_mode import judge_statistical, noise_summaries, settle


# ---------------------------------------------------------------- entry point
def compare(family: Curve | list[Curve], tests: list[Curve], tolerance: Tolerance, *, design: str | None = None,
            expect: dict[str, str] | None = None, not_compared: list[NotCompared] | None = None,
            warnings: list[str] | None = None, localize_only: set[str] | None = None) -> Comparison:
    """Judge every test curve against the control family (the control first; in exact mode only
    the control is used). `expect` maps a set name to "fail" for positive controls; `not_compared`
    lists the plan's runs without a curve (they fail the comparison); the sets of `localize_only`
    are judged by their curves alone, their fingerprints only saying where they part. Raises
    ValueError for unusable input (bad tolerance, no test set, too small a family, duplicate names)."""
    problems = tolerance.problems()
    if problems:
        raise ValueError("; ".join(problems))
    family = [family] if isinstance(family, Curve) else list(family)
    if not family:
        raise ValueError("no control curve given")
    design = design or ("exact" if tolerance.mode == "exact" else "paired")
    not_compared = list(not_compared or [])
    expect = expect or {}
    check_names(tests, allow_none=bool(not_compared))
    if tolerance.mode == "exact":
        results = [judge_exact(family[0], test, tolerance, expect.get(test.name, "pass")) for test in tests]
        noise = []
    else:
        if len(family) < 3:
            raise ValueError(f"statistical mode needs the control and at least 2 noise controls (or, unpaired, 3 "
                             f"control repeats) to measure the noise; got {len(family)} control run(s)")
        check_family_differs(family)
        results = [judge_statistical(family, test, tolerance, expect.get(test.name, "pass")) for test in tests]
        apply_plan_level([v for r in results for v in r.observables], tolerance)
        for result in results:
            settle(result)
        noise = noise_summaries(family, tolerance, judged=sum(len(r.observables) for r in results))
    localized = localize_sets(family, tests, tolerance.mode)
    add_evidence(results, localized, tolerance.mode, localize_only or set())
    comparison = Comparison(control=family[0].name, mode=tolerance.mode, design=design, tolerance=tolerance,
                            results=results, status=plan_status(results, not_compared),
                            controls=[c.name for c in family], noise=noise, not_compared=not_compared,
                            warnings=[*(warnings or []), *noisier_sets(results)],
                            fingerprints=localized, localize_only=sorted(localize_only or ()))
    if tolerance.mode == "statistical":
        comparison.family_skips = {c.name: len(skipped_steps(c)) for c in family}
        comparison.plan_false_fail = min(tolerance.plan_false_fail,
                                         sum(set_false_fail(r.observables) for r in results if r.expect == "pass"))
    return comparison


NOISIER = 2.0  # a set whose own noise raised its sigma this many times is worth its own finding
OWN_NOISE_FAILS = 5.0
"""A set whose own noise raised an observable's sigma this many times fails: correct layouts stay
far below it (docs/protocol_measurements.md, Fingerprints as evidence: calibration)."""


def noisier_sets(results: list[SetResult]) -> list[str]:
    """A correct set whose curve is noisier than the noise controls' but passed has noise of its
    own (a non-deterministic kernel, another reduction order): it is judged by that larger noise,
    which also makes it less able to show a small offset; say so."""
    return [f"{result.name}: its {o.observable} is noisier than its controls (its own noise raised sigma "
            f"{o.noise_ratio:.1f}x, to {o.noise_sd:.2e} from the family's {o.family_noise_sd:.2e}); an offset "
            "smaller than its larger detectable offset would go unseen"
            for result in results if result.expect == "pass" and not result.failed for o in result.observables
            if o.noise_ratio > NOISIER]


def add_evidence(results: list[SetResult], localized: dict, mode: str, localize_only: set[str] = frozenset()) -> None:
    """Fail each set on every kind of evidence against it and say which: its curves (already
    judged), its fingerprints (unless the set is in `localize_only`), and in statistical mode its
    own noise."""
    for result in results:
        found = []
        if result.failed:
            found.append(("curves", result.reason))
        where = localized.get(result.name)
        why = fingerprint_failure(where) if where is not None and result.name not in localize_only else None
        if why:
            found.append(("fingerprints", why))
        # A float16 set that skipped steps for an overflow has missed updates the family made (or
        # made ones it missed): a trajectory of its own that its noise shows, and not a fault.
        if mode == "statistical" and not result.skipped_steps:
            found += [("own noise", f"own noise: its {o.observable}'s own noise raised sigma {o.noise_ratio:.1f}x (to "
                                    f"{o.noise_sd:.2e} from the family's {o.family_noise_sd:.2e}), beyond "
                                    f"{OWN_NOISE_FAILS:g}x, which correct layouts stay below")
                      for o in result.observables if o.noise_ratio > OWN_NOISE_FAILS]
        result.evidence = list(dict.fromkeys(kind for kind, _ in found))
        result.failed = bool(found)
        if found and (len(found) > 1 or found[0][0] != "curves"):
            result.reason = "; ".join(why for _, why in found)


def fingerprint_failure(found) -> str | None:
    """The reason to fail a set on its fingerprints, or None."""
    if found.first_step is not None:
        top = found.causes[0].quantity if found.causes else found.groups[0].quantity
        rule = (f"tolerance {EXACT_TOLERANCE:.0e} relative" if found.mode == "exact" else
                f"beyond {found.thresholds[top]:.2f}x its own rounding noise, the plan's family-wise threshold")
        return f"fingerprints part from the control at {found.summary(top=1)} ({rule})"
    return f"fingerprints: {found.norm_check}" if found.norm_check else None


def plan_status(results: list[SetResult], not_compared: list[NotCompared]) -> str:
    """FAIL when a set that should pass fails or a run has no curve; else INCONCLUSIVE when a
    positive control passed; else PASS."""
    if not_compared or any(r.failed and r.expect == "pass" for r in results):
        return FAIL
    if any(not r.failed and r.expect == "fail" for r in results):
        return INCONCLUSIVE
    return PASS


def nothing_to_compare(control: str, tolerance: Tolerance, not_compared: list[NotCompared], note: str) -> Comparison:
    """The comparison of a plan whose control family has no curve: every set is reported, none judged."""
    design = "exact" if tolerance.mode == "exact" else "paired"
    return Comparison(control=control, mode=tolerance.mode, design=design, tolerance=tolerance, results=[],
                      status=FAIL, not_compared=not_compared, note=note)


def check_names(tests: list[Curve], allow_none: bool = False) -> None:
    if not tests and not allow_none:
        raise ValueError("no test set given")
    names = [c.name for c in tests]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"test sets must have distinct names; repeated: {', '.join(duplicates)}")


def check_family_differs(family: list[Curve]) -> None:
    """Noise controls identical to the control measure no noise: every margin would be 0."""
    first = family[0]
    if all(c.steps == first.steps and c.loss == first.loss for c in family[1:]):
        raise ValueError(f"the noise controls ({', '.join(c.name for c in family[1:])}) are bitwise identical to the "
                         f"control {first.name!r}, so they measure no noise: give them a perturbation "
                         "(debug.init_perturbation) or use exact mode for deterministic runs")


# ---------------------------------------------------------------- exact mode
def judge_exact(control: Curve, test: Curve, tol: Tolerance, expect: str = "pass") -> SetResult:
    """Every common step within loss_atol (and grad_norm_rtol when set), every control step logged."""
    result = summarize(test, control, control.steps, expect, tol)
    diff = np.asarray(result.loss_diff)
    beyond = ~(np.abs(diff) <= tol.loss_atol)
    first = int(result.steps[int(np.argmax(beyond))]) if beyond.any() else None
    neither_has_norms = test.grad_norm is None and control.grad_norm is None
    result.failed, result.reason = exact_reason(result, first, diff, tol, neither_has_norms)
    result.first_diverging_step = first if result.failed else None
    return result


def exact_reason(r: SetResult, first: int | None, diff: np.ndarray, tol: Tolerance,
                 neither_has_norms: bool = False) -> tuple[bool, str]:
    """(failed, why). Curves without any gradient norm (another trainer's) are judged on the loss
    alone, and say so; a norm logged by one side only fails."""
    if r.steps_compared == 0:
        return True, "no step in common with the control"
    if first is not None:
        d = float(diff[r.steps.index(first)])
        return True, f"step {first}: loss diff {d:+.3e} exceeds loss_atol {tol.loss_atol:.3e}"
    if tol.grad_norm_rtol > 0 and not neither_has_norms:
        if not r.grad_norm_diff:
            return True, "grad_norm_rtol is set but only one of the test and the control logged a grad norm"
        rel = np.abs(np.asarray(r.grad_norm_diff))
        beyond = ~(rel <= tol.grad_norm_rtol)
        if beyond.any():
            i = int(np.argmax(beyond))
            return True, (f"step {r.steps[i]}: grad-norm relative diff {rel[i]:.3e} exceeds grad_norm_rtol "
                          f"{tol.grad_norm_rtol:.3e}")
    if r.missing_in_test:
        return True, f"the test did not log {len(r.missing_in_test)} control step(s), first {r.missing_in_test[0]}"
    grad = f", grad norm within {tol.grad_norm_rtol:.0e}" if tol.grad_norm_rtol > 0 and r.grad_norm_diff else ""
    grad += "; no grad norm logged, so it was not judged" if neither_has_norms and tol.grad_norm_rtol > 0 else ""
    return False, f"max |loss diff| {r.max_abs_diff:.3e} <= loss_atol {tol.loss_atol:.3e} over {r.steps_compared} steps{grad}"
