"""Curves put side by side: the steps they share, their values there, and the figures every set
reports against its reference (protocol.verdict.compare's exact and statistical modes both start here)."""

from __future__ import annotations

import math

import numpy as np

from protocol.plan.tolerance import Tolerance
from protocol.verdict.curves import Curve
from protocol.verdict.results import SetResult
from protocol.verdict.statistics import window_size


def common_steps(curves: list[Curve]) -> list[int]:
    steps = set(curves[0].steps)
    for curve in curves[1:]:
        steps &= set(curve.steps)
    return sorted(steps)


def skipped_steps(curve: Curve) -> set[int]:
    """Steps the run's loss scaler skipped for a float16 overflow: those it logged as skipped, and
    for curves that do not say (TensorBoard), those with a finite loss and no gradient norm."""
    found = set(curve.skipped)
    if curve.grad_norm is not None:
        found |= {s for s, loss, norm in zip(curve.steps, curve.loss, curve.grad_norm)
                  if math.isnan(norm) and math.isfinite(loss)}
    return found


def values_at(curve: Curve, key: str, steps: list[int]) -> np.ndarray:
    """`key`'s values at `steps` (NaN where the curve lacks the series)."""
    series = curve.series(key)
    if series is None:
        return np.full(len(steps), math.nan)
    at = {s: i for i, s in enumerate(curve.steps)}
    return np.asarray([series[at[s]] for s in steps], dtype=np.float64)


def transformed(curve: Curve, observable: str, steps: list[int]) -> np.ndarray:
    """The values the rule compares: the loss as it is, the gradient norm as its log."""
    values = values_at(curve, observable, steps)
    if observable == "grad_norm":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(values)
    return values


def relative_diff(test: np.ndarray, control: np.ndarray) -> np.ndarray:
    """|test - control| / |control|; 0 where both are 0, inf where only the control is 0."""
    delta = np.abs(test - control)
    scale = np.abs(control)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(scale > 0, delta / np.where(scale > 0, scale, 1.0), np.where(delta == 0, 0.0, np.inf))
    return np.where(np.isnan(test) | np.isnan(control), np.nan, rel)


def _largest(steps: list[int], values: np.ndarray) -> tuple[float, int | None]:
    """Largest value and its step; NaN wins, since it means a diverged run."""
    if len(values) == 0:
        return math.nan, None
    nan = np.isnan(values)
    i = int(np.argmax(nan)) if nan.any() else int(np.argmax(values))
    return float(values[i]), int(steps[i])


def _max_or_none(values: np.ndarray) -> float | None:
    finite = values[~np.isnan(values)]
    return float(finite.max()) if len(finite) else None


# ---------------------------------------------------------------- the numbers every set reports
def summarize(test: Curve, reference: Curve, control_steps: list[int], expect: str, tol: Tolerance) -> SetResult:
    """Loss, grad-norm and learning-rate figures of a test against a reference curve on their
    common steps; the verdict fields are filled in by the caller."""
    steps = common_steps([test, reference])
    test_loss, ref_loss = values_at(test, "loss", steps), values_at(reference, "loss", steps)
    diff = test_loss - ref_loss
    n = len(steps)
    k = window_size(n, tol.final_window)
    max_abs, max_step = _largest(steps, np.abs(diff))
    grad_rel = relative_diff(values_at(test, "grad_norm", steps), values_at(reference, "grad_norm", steps))
    lr_rel = relative_diff(values_at(test, "lr", steps), values_at(reference, "lr", steps))
    have_grad = test.grad_norm is not None and reference.grad_norm is not None

    def at(values: np.ndarray, i: int) -> float:
        return float(values[i]) if n else math.nan

    return SetResult(
        name=test.name, expect=expect, steps_compared=n,
        missing_in_test=sorted(set(control_steps) - set(test.steps)),
        missing_in_control=sorted(set(test.steps) - set(control_steps)),
        initial_loss=at(test_loss, 0), final_loss=at(test_loss, -1),
        control_initial_loss=at(ref_loss, 0), control_final_loss=at(ref_loss, -1),
        max_abs_diff=max_abs, max_abs_diff_step=max_step,
        mean_abs_diff=float(np.mean(np.abs(diff))) if n else math.nan, final_diff=at(diff, -1),
        final_window_diff=float(np.mean(diff[n - k:])) if n else math.nan,
        grad_norm_max_rel_diff=_max_or_none(grad_rel) if have_grad else None,
        grad_norm_first_rel_diff=float(grad_rel[0]) if have_grad and n else None,
        lr_max_rel_diff=_max_or_none(lr_rel),
        first_diverging_step=None,
        steps=list(steps), loss_diff=[float(x) for x in diff],
        grad_norm_diff=[float(x) for x in (values_at(test, "grad_norm", steps) / values_at(reference, "grad_norm", steps)
                                            - 1)] if have_grad else [],
    )
