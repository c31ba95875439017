"""The numbers of the decision rule on series whose figures are known, or simulated many times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.verdict.statistics import (bartlett_bandwidth, lag_one_correlation, mean_with_stderr, t_quantile,
                                         t_upper_tail, trend_with_stderr, window_size)


def ar1(rng, n: int, rho: float, sd: float = 1.0) -> np.ndarray:
    """An AR(1) series started in its stationary distribution."""
    x = np.empty(n)
    x[0] = rng.normal(0, sd / math.sqrt(1 - rho ** 2))
    shocks = rng.normal(0, sd, n)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + shocks[t]
    return x


def test_window_size_covers_the_fraction():
    assert window_size(50, 0.1) == 5
    assert window_size(30, 0.1) == 3  # 0.1 x 30 is 3.0000000000000004 in floating point
    assert window_size(31, 0.1) == 4
    assert window_size(5, 0.1) == 1  # at least one step
    assert window_size(7, 1.0) == 7
    assert window_size(0, 0.1) == 0


def test_student_t_against_table_values():
    assert t_quantile(0.95, 4) == pytest.approx(2.1318, abs=1e-4)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-4)
    assert t_upper_tail(2.1318, 4) == pytest.approx(0.05, abs=1e-4)
    assert math.isnan(t_upper_tail(math.nan, 4))


def test_independent_points_count_fully():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2.0, 400)
    estimate = mean_with_stderr(x)
    assert estimate.mean == pytest.approx(float(x.mean()))
    assert estimate.stderr == pytest.approx(float(x.std()) / 20, rel=0.15)
    assert estimate.effective_n > 300
    assert abs(lag_one_correlation(x)) < 0.1 and bartlett_bandwidth(x) < 2


@pytest.mark.parametrize("rho, n", [(0.9, 150), (0.8, 30)])
def test_autocorrelated_series_count_as_fewer_points_and_the_error_is_calibrated(rho, n):
    """For AR(1) the variance of a mean of n points is about (1 + rho) / (1 - rho) times the
    independent one (19 at rho 0.9). Over 400 simulated series the standard error comes within 15%
    of the spread of the means themselves, also for a final window of 30 points, where Newey-West
    alone gives about half of it; a naive error would be 2.7 to 4.4 times too small."""
    rng = np.random.default_rng(1)
    means, errors, effective = [], [], []
    for _ in range(400):
        estimate = mean_with_stderr(ar1(rng, n, rho))
        means.append(estimate.mean)
        errors.append(estimate.stderr)
        effective.append(estimate.effective_n)
    actual = float(np.std(means))
    assert np.mean(errors) == pytest.approx(actual, rel=0.15)
    expected_points = n * (1 - rho) / (1 + rho)  # 7.9 and 3.3
    assert expected_points / 2 < np.median(effective) < expected_points * 2
    naive = 1 / math.sqrt(1 - rho ** 2) / math.sqrt(n)
    assert actual > 2.5 * naive


def test_constant_and_short_series():
    assert mean_with_stderr(np.full(10, 3.0)).stderr == 0.0
    assert math.isnan(mean_with_stderr(np.array([1.0, 2.0])).stderr)
    assert math.isnan(mean_with_stderr(np.array([])).mean)


def test_trend_of_known_lines_and_noisy_ones():
    steps = np.arange(1, 101, dtype=float)
    line = trend_with_stderr(steps, 2.0 * steps + 1.0)
    assert line.slope == pytest.approx(2.0) and line.stderr == pytest.approx(0.0, abs=1e-9)
    assert line.span == 99 and line.drift == pytest.approx(198.0)
    rng = np.random.default_rng(2)
    slopes, errors = [], []
    for _ in range(300):
        estimate = trend_with_stderr(steps, 0.01 * steps + ar1(rng, 100, 0.8, 0.05))
        slopes.append(estimate.slope)
        errors.append(estimate.stderr)
    assert np.mean(slopes) == pytest.approx(0.01, abs=2e-4)
    assert np.mean(errors) == pytest.approx(np.std(slopes), rel=0.15)
    assert math.isnan(trend_with_stderr(steps[:2], steps[:2]).stderr)
