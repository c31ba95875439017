"""The statistical decision rule: does a test set train like the control, observable by observable?

Setting. The control C and its K noise controls N_1..N_K (the *control family*, K + 1 runs)
train on identical data from identical weights; each noise control differs from C only by a
rounding-level perturbation of its initial weights. A test set T trains on the same data from the
same weights. For an observable y (the loss in nats; the log of the gradient norm, so that its
differences are relative), r_t is the family's mean at step t and d_t = y_T(t) - r_t the paired
difference. D is the mean of d_t over the final window (the last `final_window` of the steps).

Noise. Were T one more member of the family, D would scatter like the family's own window means
about their mean: with s the noise SD of one run's window mean, D has standard deviation
sigma = s sqrt(1 + 1/(K + 1)). s is estimated twice and the larger estimate used: the sample
standard deviation of the family's window means (K degrees of freedom: the runs are the
replicates, so it holds however strongly each curve is autocorrelated, and whatever part of the
noise persists through a whole window, which no single curve shows), and the members' own
autocorrelation-aware standard errors pooled (protocol.verdict.statistics: many more effective points,
so K + 1 runs whose window means happen to agree cannot shrink sigma). The t quantiles keep K
degrees of freedom. A test set may add noise of its own at every step (a non-deterministic
kernel only its layout uses): whatever the variance of its window mean, read from its own curve
over the last three windows, exceeds a member's (read the same way from theirs) is added to
sigma^2 (with_own_noise), so that a noisier but unbiased set is not failed by a sigma that
understates it; a set much noisier than its controls is reported as such.

1. Equivalence of the final-window mean (two one-sided tests, TOST), mu the expectation of D:
       H0: |mu| >= margin   (the set is off by at least the margin)
       H1: |mu| <  margin   (the set is equivalent to the control)
   margin = margin_sigmas x sigma, unless the plan gives one. H0 is rejected, and the set is
   equivalent, when D - t sigma > -margin and D + t sigma < margin, t the 1 - alpha quantile of
   Student's t with K degrees of freedom; p is the larger of the two one-sided p-values. With a
   derived margin the test is |D| / sigma < margin_sigmas - t, and D / sigma is Student-t with K
   degrees of freedom for a correct set: the false-fail rate is P(|t_K| > margin_sigmas - t).

2. Drift of the difference over the run:
       H0: d_t has the trend of rounding noise   H1: it drifts
   b is the least-squares slope of d_t on the step; the family members' own slopes (each one's
   deviation from r_t) give its noise, SE_b = max(their spread x sqrt(1 + 1/(K + 1)), the
   autocorrelation-aware standard error of b from T's own curve). The set drifts when H0 is
   rejected (two-sided, level alpha)
   AND |b| x (steps spanned) > margin: a trend that moves the difference by less than the margin
   over the whole run cannot take the set out of equivalence, so it is reported, not judged.

An observable passes when it is equivalent and does not drift; a set passes when every judged
observable passes. Over a whole plan the failures are then held to the plan's false-fail level
by Holm's step-down (protocol.verdict.family_wise): an observable the rule fails still passes when its
failure is not significant once every (set, observable) of the plan is counted. Minimum detectable effect: the offset mu at which a set fails test 1 with
probability `power`, from the noise alone: margin - t sigma + t_power sigma (t_power the `power`
quantile of Student's t with K degrees of freedom).

Without pairing (curves of runs on different data, e.g. another trainer's seed repeats), the
family is the control repeats and the same rule runs on their spread, which then holds the data's
noise too: far larger, so only far larger effects can be detected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protocol.plan.tolerance import Tolerance
from protocol.verdict.statistics import (ar1_variance_factor, bartlett_bandwidth, chi2_quantile, long_run_variance,
                                         mean_with_stderr, normal_quantile, ols_slope, t_quantile, t_upper_tail,
                                         trend_with_stderr, window_size)

# The locator of the first diverging step: the difference must leave the family's per-step noise
# envelope (ENVELOPE_SIGMAS x its spread, smoothed over +-SMOOTHING steps) and stay out for
# STAY_OUT steps in a row, so that one noisy step is not taken for the start of a divergence.
ENVELOPE_SIGMAS = 4.0
SMOOTHING = 5
STAY_OUT = 5


SAY_NOISIER = 1.5
"""A set this many times noisier than a noise control has it said in its verdict's reason (a set
only slightly noisier is still judged by its own noise; the fields always show the ratio)."""


@dataclass
class ObservableVerdict:
    """One observable of one set: the numbers of both tests and the verdict."""

    observable: str
    steps: int
    """Steps compared (those where every run logged a finite value)."""
    window_steps: int
    window_first_step: int | None
    diff: float
    """D: final-window mean of the paired difference (nats for the loss, log ratio for the norm)."""
    noise_sd: float
    """sigma: the standard deviation of D for a correct set, from the control family."""
    within_se: float
    """D's autocorrelation-aware standard error from the set's own series (reported)."""
    family_within_se: float
    """The largest such error among the family's members (their own series): a set far noisier
    than every noise control may have more rounding noise than they measure."""
    effective_n: float
    """Independent points the window's differences are worth (autocorrelation)."""
    dof: int
    margin: float
    margin_given: bool
    """True when the plan set the margin; else it is margin_sigmas x noise_sd."""
    tost_p: float
    equivalent: bool
    slope: float
    slope_se: float
    drift: float
    """|slope| x steps spanned: how far the trend moves the difference over the run."""
    drift_p: float
    drifting: bool
    mde: float
    """The offset this test detects with the tolerance's power."""
    first_outside_noise: int | None
    """First step where the difference leaves the noise envelope and stays out (a locator)."""
    passed: bool
    reason: str
    family_noise_sd: float = math.nan
    """The control family's sigma; noise_sd adds the set's own excess noise to it (with_own_noise)."""
    p_value: float = math.nan
    """The chance a correct set fails this observable as clearly (protocol.verdict.family_wise)."""
    holm_threshold: float = math.nan
    """The level Holm's step-down compared p_value with (the plan's level / hypotheses left)."""
    bound: float = math.nan
    """The |D| from which this observable fails, as applied: the margin's floor (margin - t sigma)
    or the plan-level bound, whichever is larger."""
    chance_fail: float = math.nan
    """At most the chance that a correct set's |D| reaches `bound`."""

    @property
    def noise_ratio(self) -> float:
        """How far the set's own noise raised sigma above the family's (1: not at all)."""
        return self.noise_sd / self.family_noise_sd if self.family_noise_sd > 0 else 1.0

    @property
    def noisier_than_family(self) -> bool:
        return self.noise_sd > self.family_noise_sd


def own_errors(window_rows: np.ndarray) -> list[float]:
    """Each family member's autocorrelation-aware standard error of its window mean, from its own
    curve's deviation from the family mean (NaN where a window is too short)."""
    reference = window_rows.mean(axis=0)
    return [mean_with_stderr(row - reference).stderr for row in window_rows]


def noise_parts(window_rows: np.ndarray) -> tuple[float, float]:
    """(between, within): a run's window-mean noise SD estimated from the spread of the members'
    window means (K degrees of freedom; holds noise that persists through a window), and from the
    members' own standard errors pooled (many more effective points; a deviation from the family
    mean has 1 - 1/(K+1) of a run's variance)."""
    members = len(window_rows)
    between = float(np.std(window_rows.mean(axis=1), ddof=1))
    errors = [e for e in own_errors(window_rows) if math.isfinite(e)]
    within = math.sqrt(float(np.mean(np.square(errors))) / (1 - 1 / members)) if errors else 0.0
    return between, within


def family_noise_sd(window_rows: np.ndarray) -> float:
    """sigma: standard deviation of a new member's window mean about the family's mean, from the
    family's final windows (members x steps): the larger of the two estimates of noise_parts."""
    return max(noise_parts(window_rows)) * math.sqrt(1 + 1 / len(window_rows))


OWN_NOISE_SPAN = 3
"""A set's own noise is read from the last OWN_NOISE_SPAN final windows of its difference: a
window alone holds too few independent points to estimate it (about 1.6 in 30 steps of AR(1)
noise with rho 0.9), and its estimate would understate it."""


def segment_stderr(x: np.ndarray, k: int) -> float:
    """Standard error of a k-step mean of x's noise, from x's last OWN_NOISE_SPAN x k points with
    their linear trend removed: sqrt(long-run variance / k), the larger of the Newey-West and the
    AR(1) forms (an upper bound for a window of k, whose own correlation only lowers it)."""
    tail = np.asarray(x[-OWN_NOISE_SPAN * k:], dtype=np.float64)
    if len(tail) < 4:
        return math.nan
    steps = np.arange(len(tail), dtype=np.float64)
    residual = tail - np.polyval(np.polyfit(steps, tail, 1), steps)
    variance = float(residual @ residual) / len(residual)
    lrv = max(long_run_variance(residual, bartlett_bandwidth(residual)), variance * ar1_variance_factor(residual))
    return math.sqrt(lrv / k)


def with_own_noise(family_sigma: float, family: np.ndarray, d: np.ndarray, k: int) -> float:
    """sigma for a set that may add noise of its own: the family's, plus (in quadrature) whatever
    the variance of the set's k-step mean, by its own curve (segment_stderr), exceeds what a
    member's would be by the members' own curves (a member's deviation from the family mean
    carries 1 - 1/(K+1) of a run's variance, a set's difference 1 + 1/(K+1)). A set as noisy as
    a noise control keeps the family's sigma; a noisier one is judged by the larger."""
    members = len(family)
    reference = family.mean(axis=0)
    errors = [segment_stderr(row - reference, k) for row in family]
    errors = [e for e in errors if math.isfinite(e)]
    own = segment_stderr(d, k)
    if not math.isfinite(own) or not errors:
        return family_sigma
    expected = float(np.mean(np.square(errors))) * (1 + 1 / members) / (1 - 1 / members)
    return math.sqrt(family_sigma ** 2 + max(0.0, own ** 2 - expected))


def minimum_detectable_effect(margin: float, sigma: float, dof: int, tol: Tolerance) -> float:
    """The offset at which the equivalence test fails with probability tol.power (D / sigma is
    Student-t with dof degrees of freedom about the offset)."""
    return margin - t_quantile(1 - tol.alpha, dof) * sigma + t_quantile(tol.power, dof) * sigma


def noise_sd_upper(sigma: float, dof: int, confidence: float = 0.95) -> float:
    """The upper `confidence` bound of the true noise SD, estimated as sigma from dof + 1 runs:
    sigma sqrt(dof / chi2_(1 - confidence, dof)) (2.37 sigma with 4 noise controls)."""
    return sigma * math.sqrt(dof / chi2_quantile(1 - confidence, dof))


def detectable_if_noisier(margin: float, sigma: float, dof: int, tol: Tolerance) -> float:
    """The offset failed with probability tol.power if the true noise SD were at the upper 95%
    bound of its estimate (the pass threshold margin - t sigma stays what the data gave)."""
    upper = noise_sd_upper(sigma, dof)
    return margin - t_quantile(1 - tol.alpha, dof) * sigma + normal_quantile(tol.power) * upper


def false_fail_chance(margin: float, sigma: float, dof: int, tol: Tolerance) -> float:
    """An upper bound of the chance that a correct set fails the equivalence test:
    P(|t| > (margin - t_crit sigma) / sigma) for Student's t with dof degrees of freedom, exact were
    sigma the family's spread alone; the larger of the two noise estimates only makes it rarer."""
    if sigma == 0:
        return 0.0
    return 2 * t_upper_tail((margin - t_quantile(1 - tol.alpha, dof) * sigma) / sigma, dof)


def margin_for(observable: str, sigma: float, tol: Tolerance) -> tuple[float, bool]:
    given = tol.margin(observable)
    return (given, True) if given > 0 else (tol.margin_sigmas * sigma, False)


def judge(steps: np.ndarray, family: np.ndarray, test: np.ndarray, observable: str,
          tol: Tolerance) -> ObservableVerdict:
    """The rule above for one observable. `family` is (members, steps), the control first;
    `test` is (steps,); both already transformed (log for the gradient norm) and finite."""
    members, n = family.shape
    dof = members - 1
    reference = family.mean(axis=0)
    d = test - reference
    k = window_size(n, tol.final_window)
    window = slice(n - k, n)
    family_sigma = family_noise_sd(family[:, window])
    own = mean_with_stderr(d[window])
    family_own = own_errors(family[:, window])
    sigma = with_own_noise(family_sigma, family, d, k)
    margin, given = margin_for(observable, sigma, tol)
    t_crit = t_quantile(1 - tol.alpha, dof)
    tost_p = tost_p_value(own.mean, sigma, margin, dof)
    # A family without any spread in this observable (a constant norm, say) leaves no margin:
    # then only an identical set is equivalent.
    equivalent = abs(own.mean) + t_crit * sigma < margin or (margin == 0 and own.mean == 0)

    trend = trend_with_stderr(steps, d)
    member_slopes = np.array([ols_slope(steps, row - reference) for row in family])
    slope_noise = math.sqrt(float(member_slopes @ member_slopes) / dof) * math.sqrt(1 + 1 / members)
    slope_se = max(slope_noise, trend.stderr if math.isfinite(trend.stderr) else 0.0)
    drift_p = 2 * t_upper_tail(abs(trend.slope) / slope_se, dof) if slope_se > 0 else (
        0.0 if trend.slope else 1.0)
    drifting = drift_p < tol.alpha and trend.drift > margin

    passed = equivalent and not drifting
    verdict = ObservableVerdict(
        observable=observable, steps=n, window_steps=k, window_first_step=int(steps[n - k]) if k else None,
        diff=own.mean, noise_sd=sigma, within_se=own.stderr,
        family_within_se=max((e for e in family_own if math.isfinite(e)), default=math.nan),
        effective_n=own.effective_n, dof=dof,
        margin=margin, margin_given=given, tost_p=tost_p, equivalent=equivalent, slope=trend.slope,
        slope_se=slope_se, drift=trend.drift, drift_p=drift_p, drifting=drifting,
        mde=minimum_detectable_effect(margin, sigma, dof, tol),
        first_outside_noise=None if passed else first_outside_noise(steps, family, d),
        passed=passed, reason="", family_noise_sd=family_sigma)
    verdict.reason = explain(verdict, t_crit)
    return verdict


def tost_p_value(diff: float, se: float, margin: float, dof: int) -> float:
    """The larger of the two one-sided p-values of H0: |mu| >= margin."""
    if se == 0:
        return 0.0 if abs(diff) < margin else 1.0
    lower = t_upper_tail((diff + margin) / se, dof)  # H0: mu <= -margin
    upper = t_upper_tail((margin - diff) / se, dof)  # H0: mu >= +margin
    return max(lower, upper)


def first_outside_noise(steps: np.ndarray, family: np.ndarray, d: np.ndarray) -> int | None:
    """First step from which |d| exceeds ENVELOPE_SIGMAS x the family's smoothed per-step spread
    for STAY_OUT steps in a row (or until the last step)."""
    members = family.shape[0]
    spread = family.std(axis=0, ddof=1) * math.sqrt(1 + 1 / members)
    kernel = np.ones(2 * SMOOTHING + 1)
    smoothed = np.sqrt(np.convolve(spread ** 2, kernel, "same") / np.convolve(np.ones_like(spread), kernel, "same"))
    outside = np.abs(d) > ENVELOPE_SIGMAS * smoothed
    n = len(d)
    for i in range(n):
        if outside[i:i + STAY_OUT].all():
            return int(steps[i])
    return None


def explain(v: ObservableVerdict, t_crit: float) -> str:
    """One sentence: what decided the verdict, with its numbers."""
    unit = "" if v.observable == "loss" else " (log ratio)"
    window = f"final-window ({v.window_steps} steps from {v.window_first_step}) mean diff {v.diff:+.2e}{unit}"
    limit = v.margin - t_crit * v.noise_sd
    if v.margin == 0:
        return (f"{window}: the control family's values are identical (no noise to judge by), "
                + ("and the set's equal them" if v.equivalent else "and the set's differ from them"))
    if limit <= 0:
        return (f"{window}: the margin {v.margin:.2e} is not wider than t x noise SD = {t_crit * v.noise_sd:.2e}, so "
                "no set can pass; give more noise controls or a wider margin")
    noisier = (f"; its own curve is noisier than a noise control's, so it is judged by a noise SD of "
               f"{v.noise_sd:.2e} ({v.noise_ratio:.2f}x the family's {v.family_noise_sd:.2e})"
               if v.noise_ratio >= SAY_NOISIER else "")
    if math.isfinite(v.bound):
        return explain_plan_level(v, window, noisier)
    if not v.equivalent:
        return (f"{window} is not shown within the margin +-{v.margin:.2e} (|diff| + t x noise SD = "
                f"{abs(v.diff) + t_crit * v.noise_sd:.2e}; TOST p {v.tost_p:.2g}){noisier}")
    if v.drifting:
        return (f"the diff drifts: slope {v.slope:+.2e}/step (p {v.drift_p:.2g}) moves it {v.drift:.2e} over the run, "
                f"more than the margin {v.margin:.2e}")
    return f"{window} within +-{v.margin:.2e} (TOST p {v.tost_p:.2g}); no drift (p {v.drift_p:.2g}){noisier}"


def explain_plan_level(v: ObservableVerdict, window: str, noisier: str) -> str:
    """The sentence once the plan-level bound is known: |D| against the bound applied."""
    sigmas = f"{abs(v.diff) / v.noise_sd:.1f}" if v.noise_sd > 0 else "inf"
    against = (f"|diff| = {sigmas} noise SD against a bound of {v.bound:.2e} ({v.bound / v.noise_sd:.2f} noise SD; "
               f"p {v.p_value:.2g}, plan-level threshold {v.holm_threshold:.2g})")
    if not v.passed and v.drifting and v.equivalent:
        return (f"the diff drifts: slope {v.slope:+.2e}/step (p {v.drift_p:.2g}) moves it {v.drift:.2e} over the run, "
                f"more than the margin {v.margin:.2e}{noisier}")
    if not v.passed:
        return f"{window}: {against}{noisier}"
    drift = f"; no drift (p {v.drift_p:.2g})" if not v.drifting else (
        f"; a drift of {v.drift:.2e} (p {v.drift_p:.2g}) is not significant at the plan level")
    return f"{window} within the bound: {against}{drift}{noisier}"
