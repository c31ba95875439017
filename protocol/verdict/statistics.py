"""The numbers the decision rule (protocol.verdict.decision) is made of, for series that are strongly
autocorrelated, as loss curves and their differences are.

* window means, and the variance of a mean under autocorrelation, so that a series whose
  neighbours move together counts as fewer independent points (its effective sample size). Two
  estimates of the long-run variance are taken and the larger one used: Newey-West (Bartlett
  kernel, Andrews' AR(1) plug-in bandwidth), which assumes no model but underestimates badly in
  short, strongly correlated windows (simulated AR(1), rho 0.8, 30 points: 0.55 of the true
  standard error), and the AR(1) form gamma_0 (1 + rho) / (1 - rho) with rho corrected for its
  small-sample bias (Kendall: + (1 + 3 rho) / n), calibrated within 16% from 30 points on;
* least-squares trends with the same two standard errors for the slope;
* Student-t tails and quantiles (scipy).

Everything here is a pure function of numpy arrays: no files, no plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

# The AR(1) coefficient used for the bandwidth is capped: at rho -> 1 the plug-in bandwidth
# diverges, and a bandwidth near the series length leaves no variance to estimate.
MAX_RHO = 0.97


def window_size(n_steps: int, fraction: float) -> int:
    """Steps in the final window: the fewest that cover `fraction` of n_steps, at least 1.

    The small epsilon keeps float products such as 0.1 x 30 = 3.0000000000000004 from rounding up.
    """
    if n_steps == 0:
        return 0
    return min(n_steps, max(1, math.ceil(fraction * n_steps - 1e-9)))


def lag_one_correlation(x: np.ndarray) -> float:
    """First-order autocorrelation of x (0 for a constant or too short series)."""
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    denominator = float(x @ x)
    if len(x) < 3 or denominator == 0.0:
        return 0.0
    return float(x[1:] @ x[:-1]) / denominator


def bartlett_bandwidth(x: np.ndarray) -> float:
    """Andrews (1991) plug-in bandwidth of the Bartlett kernel for an AR(1) approximation of x:
    1.1447 (4 rho^2 / ((1 - rho)^2 (1 + rho)^2) n)^(1/3), at most n - 1."""
    n = len(x)
    rho = min(max(lag_one_correlation(x), -MAX_RHO), MAX_RHO)
    alpha = 4 * rho ** 2 / ((1 - rho) ** 2 * (1 + rho) ** 2)
    return float(min(1.1447 * (alpha * n) ** (1 / 3), n - 1)) if n > 1 else 0.0


def ar1_variance_factor(u: np.ndarray) -> float:
    """(1 + rho) / (1 - rho) for the lag-1 correlation rho of u, corrected for its small-sample
    bias (Kendall 1954: E[rho_hat] ~ rho - (1 + 3 rho) / n), rho kept in [0, MAX_RHO]."""
    n = len(u)
    rho = lag_one_correlation(u)
    rho = min(max(rho + (1 + 3 * rho) / n, 0.0), MAX_RHO) if n > 3 else 0.0
    return (1 + rho) / (1 - rho)


def long_run_variance(u: np.ndarray, bandwidth: float) -> float:
    """sum over lags k of w_k gamma_k (gamma: autocovariances of u about 0, w: Bartlett weights
    1 - |k| / bandwidth); the variance of sum(u) / sqrt(n) under autocorrelation."""
    n = len(u)
    total = float(u @ u) / n
    for k in range(1, int(math.ceil(bandwidth))):
        weight = 1.0 - k / bandwidth
        if weight <= 0:
            break
        total += 2 * weight * float(u[k:] @ u[:-k]) / n
    return max(total, 0.0)


@dataclass(frozen=True)
class MeanEstimate:
    """The mean of a series and its standard error under autocorrelation."""

    mean: float
    stderr: float
    effective_n: float
    """Independent points the series is worth: n x (variance / long-run variance), at most n."""


def mean_with_stderr(x: np.ndarray) -> MeanEstimate:
    """Mean of x with a Newey-West standard error (Bartlett kernel, plug-in bandwidth)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n == 0:
        return MeanEstimate(math.nan, math.nan, 0.0)
    mean = float(np.mean(x))
    if n < 3:
        return MeanEstimate(mean, math.nan, float(n))
    centered = x - mean
    variance = float(centered @ centered) / n
    lrv = max(long_run_variance(centered, bartlett_bandwidth(centered)), variance * ar1_variance_factor(centered))
    if lrv == 0.0:
        return MeanEstimate(mean, 0.0, float(n))
    return MeanEstimate(mean, math.sqrt(lrv / n), float(min(n, n * variance / lrv)))


@dataclass(frozen=True)
class TrendEstimate:
    """Least-squares line through a series over steps, with a standard error under autocorrelation."""

    slope: float
    """Change per step."""
    stderr: float
    span: float
    """last step - first step: slope x span is how far the line moves over the series."""

    @property
    def drift(self) -> float:
        return abs(self.slope) * self.span


def ols_slope(steps: np.ndarray, y: np.ndarray) -> float:
    x = np.asarray(steps, dtype=np.float64)
    dx = x - x.mean()
    sxx = float(dx @ dx)
    return float(dx @ (np.asarray(y, dtype=np.float64) - np.mean(y))) / sxx if sxx > 0 else 0.0


def trend_with_stderr(steps: np.ndarray, y: np.ndarray) -> TrendEstimate:
    """OLS slope of y on steps; its standard error the larger of Newey-West's (from the products
    dx_t u_t of the centred steps and the residuals) and the AR(1) form (the OLS variance of the
    residuals times (1 + rho) / (1 - rho): a trend regressor is as correlated as it gets). NaN
    with fewer than 3 points."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 2:
        return TrendEstimate(0.0, math.nan, 0.0)
    span = float(x[-1] - x[0])
    slope = ols_slope(x, y)
    if n < 3:
        return TrendEstimate(slope, math.nan, span)
    dx = x - x.mean()
    residual = y - y.mean() - slope * dx
    scores = dx * residual
    sxx = float(dx @ dx)
    newey_west = n * long_run_variance(scores, bartlett_bandwidth(residual)) / sxx ** 2
    ar1 = float(residual @ residual) / (n - 2) / sxx * ar1_variance_factor(residual)
    return TrendEstimate(slope, math.sqrt(max(newey_west, ar1)), span)


def t_upper_tail(value: float, dof: float) -> float:
    """P(T > value) for Student's t with `dof` degrees of freedom."""
    if math.isnan(value):
        return math.nan
    return float(stats.t.sf(value, dof))


def t_quantile(probability: float, dof: float) -> float:
    """The value Student's t with `dof` degrees of freedom stays below with `probability`."""
    return float(stats.t.ppf(probability, dof))


def chi2_quantile(probability: float, dof: float) -> float:
    """The value a chi-squared variable with `dof` degrees of freedom stays below with `probability`."""
    return float(stats.chi2.ppf(probability, dof))


def normal_quantile(probability: float) -> float:
    return float(stats.norm.ppf(probability))
