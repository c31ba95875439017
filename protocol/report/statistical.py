"""report.md's statistical sections: what the plan can detect and how often it fails a correct set;
why each set passed or failed (the bound applied to it, its p-value against its Holm threshold);
every number of both tests."""

from __future__ import annotations

import math

from protocol.report.findings import lr_cell
from protocol.report.formats import fmt_diff, fmt_p, fmt_share, fmt_sigmas, markdown_table
from protocol.verdict.decision import SAY_NOISIER, ObservableVerdict
from protocol.verdict.family_wise import set_false_fail
from protocol.verdict.fingerprint_noise import FALSE_FAIL
from protocol.verdict.results import Comparison

UNITS = {"loss": "nats", "grad_norm": "log ratio (about relative)"}


def detectable_section(comparison: Comparison) -> list[str]:
    if not comparison.noise:
        return []
    tol = comparison.tolerance
    lines = ["## What this plan can detect", "",
             f"From the control family ({len(comparison.controls)} runs): the standard deviation of a correct set's "
             f"final-window difference (noise SD), the margin, the smallest final-window offset a set fails with "
             f"probability {tol.power:g} (detectable offset; in brackets, the same if the true noise SD were at the "
             "upper 95% bound of this estimate from few runs), the same once every set of the plan is counted (plan "
             "level: under Holm's strictest threshold), and at most how often a correct set fails by noise alone. "
             "The step columns are the root mean square of the noise controls' paired difference from the control "
             "around that step: how far rounding alone moves runs apart.", ""]
    growth_steps = [step for step, _ in comparison.noise[0].growth]
    header = ["observable", "unit", "noise SD", "margin", "detectable offset", "plan-level detectable offset",
              "false-fail chance", *[f"step {s}" for s in growth_steps]]
    rows = [[n.observable, UNITS.get(n.observable, ""), fmt_diff(n.noise_sd), fmt_diff(n.margin),
             f"{fmt_diff(n.mde)} ({fmt_diff(n.mde_if_noisier)})", fmt_diff(n.plan_mde), f"<= {n.false_fail:.1%}",
             *[fmt_diff(value) for _, value in n.growth]] for n in comparison.noise]
    return lines + markdown_table(header, rows) + [""] + false_fail_lines(comparison)


def false_fail_lines(comparison: Comparison) -> list[str]:
    """The plan's chance of failing were every set correct, and each correct set's own."""
    if comparison.plan_false_fail is None:
        return []
    judged = sum(len(r.observables) for r in comparison.results)
    correct = [r for r in comparison.results if r.expect == "pass" and r.observables]
    own = ", ".join(f"{r.name} <= {fmt_share(set_false_fail(r.observables))}" for r in correct)
    return [f"False fails: were every set correct, this plan would fail by chance with probability at most "
            f"{fmt_share(comparison.plan_false_fail)} (Holm's step-down over its {judged} judged observables at the "
            f"plan's level {comparison.tolerance.plan_false_fail:g}, under the bounds applied below)"
            + (f"; each correct set on its own: {own}." if own else ".")
            + (f" Their fingerprints add at most {FALSE_FAIL:.0%} (a family-wise threshold over every entry of every "
               "recorded step of every set)." if comparison.fingerprints else ""), ""]


def verdict_cell(v: ObservableVerdict) -> str:
    if v.passed:
        return "pass"
    if v.drifting and not abs(v.diff) >= v.bound:
        return "fail: drifts"
    return "fail: |diff| >= bound"


def why_section(comparison: Comparison) -> list[str]:
    """Per set and observable: |D| against the bound applied, in noise SDs too, and the p-value
    against its Holm threshold."""
    rows = []
    for r in comparison.results:
        for v in r.observables:
            noisier = " (noisier)" if v.noise_ratio >= SAY_NOISIER else ""
            rows.append([r.name, v.observable, fmt_diff(v.diff, signed=True), fmt_diff(v.noise_sd),
                         fmt_sigmas(abs(v.diff), v.noise_sd), fmt_diff(v.bound), fmt_sigmas(v.bound, v.noise_sd),
                         fmt_p(v.p_value), fmt_p(v.holm_threshold), f"{v.noise_ratio:.2f}{noisier}", verdict_cell(v)])
    if not rows:
        return []
    lines = ["## Why each set passed or failed", ""]
    lines += markdown_table(["set", "observable", "window diff", "noise SD", "|diff| (noise SDs)", "bound",
                             "bound (noise SDs)", "p", "Holm threshold", "noise ratio", "verdict"], rows)
    lines += ["", "window diff and bound are in nats for the loss, as a log ratio (about relative) for the gradient "
                  "norm. bound: the |diff| from which the observable fails, as applied to this set: the larger of the "
                  "margin's floor (margin - t noise SD, the equivalence test) and the plan-level bound (the |diff| "
                  "whose p-value reaches its Holm threshold); it differs between sets, since each has its own "
                  "threshold and noise. p: the chance that a correct set fails this observable at least as clearly "
                  "(offset and drift tests combined); Holm threshold: the level it was compared with (the plan's "
                  "false-fail level over the hypotheses left in Holm's step-down). noise ratio: the set's noise "
                  "SD over the family's, above 1 when the set's own curve is noisier than a noise control's and "
                  "that excess was added to it. The figures draw the same: each set's window diff with its noise "
                  "SD against its bound.", ""]
    return lines


def details_section(comparison: Comparison) -> list[str]:
    rows = []
    for r in comparison.results:
        for o in r.observables:
            rows.append([r.name, o.observable, fmt_diff(o.diff, signed=True), fmt_diff(o.noise_sd),
                         f"{fmt_diff(o.within_se)} ({fmt_diff(o.family_within_se)})", f"{o.effective_n:.0f}",
                         fmt_diff(o.margin) + (" (given)" if o.margin_given else ""),
                         fmt_p(o.tost_p), fmt_diff(o.slope, signed=True), fmt_diff(o.drift), fmt_p(o.drift_p),
                         str(o.first_outside_noise or "-"), "pass" if o.passed else "fail"])
    lines = ["## Details", ""]
    lines += markdown_table(["set", "observable", "window diff", "noise SD", "own SE (family's)", "ESS", "margin",
                             "TOST p", "slope/step", "drift over run", "drift p", "first step outside noise",
                             "verdict"], rows)
    lines += ["", "window diff: the set's mean paired difference over the final window; noise SD: its standard "
                  "deviation for a correct set (control family); own SE: its autocorrelation-aware standard error from "
                  "the set's own series, in brackets the largest of the family members' own (reported, not used: a set "
                  "far noisier than them gets a warning), ESS the independent points the set's series is worth; TOST "
                  "p < alpha shows equivalence (with a margin derived from the noise, it is the same test as |diff| "
                  "< (margin_sigmas - t) noise SDs); drift "
                  "p < alpha with a drift over the run above the margin fails the set. Learning-rate differences "
                  f"(largest relative; equal: below float rounding): {lr_differences(comparison)}.", ""]
    return lines


def lr_differences(comparison: Comparison) -> str:
    return ", ".join(f"{r.name} {lr_cell(r.lr_max_rel_diff)}" for r in comparison.results)


def bound_or_margin(v: ObservableVerdict) -> float:
    """The verdict table's bracket: the bound applied, or the margin before the plan level was set."""
    return v.bound if math.isfinite(v.bound) else v.margin
