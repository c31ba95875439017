"""Statistical mode's unit for a fingerprint: how far rounding alone moves each entry at each
step, measured by the control family (the control and its noise controls), and the threshold
beyond which a set's deviation is evidence.

A set's entry is compared with the family's mean, as its curves are. The unit of entry e of
quantity q at step s is the standard deviation a correct set's relative difference from that mean
has, a(q, e) x g(q, s) x sqrt(1 + 1/(K + 1)) for K noise controls:
  g(q, s)  the family's relative spread about its mean (ddof 1) over every entry of q at step s:
           how rounding noise grows with the steps;
  a(q, e)  the entry's own share of that noise, over every recorded step: a noisy layer gets a
           wide unit and a quiet one a narrow unit, where pooling the layers of a module gave both
           the same (a noisy one raised false alarms, a quiet one hid a bug).
A correct set's difference over its unit is then about Student-t, with K x S degrees of freedom
for a(q, e) from S recorded steps and K x n for g(q, s) from n entries; `dof` combines the two
(the variance of a product of two estimates adds their relative variances), times
DOF_EFFICIENCY for the heavier tail such a product has.

The threshold is family-wise: a correct set is one of `sets` x entries x steps comparisons of the
plan, and the plan should fail on them with probability at most FALSE_FAIL, so each quantity uses
the two-sided t quantile at FALSE_FAIL / (2 x comparisons) for its degrees of freedom (Bonferroni;
the entries are correlated, which only lowers the rate). How often correct layouts exceed it is
measured, not assumed: docs/protocol_measurements.md (Fingerprints as evidence).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.verdict.statistics import t_quantile

FALSE_FAIL = 0.01  # of plans whose every set is correct, at most this share fails on fingerprints
LAYOUT_TAILS = 2.0
"""Correct layouts are not quite draws like the noise controls: their rounding differs at every
step (another reduction order) where a noise control's differs by one perturbation at the start,
and their deviations have heavier tails. Measured on the tiny model (bfloat16, synthetic_context,
TP 2, PP 2, CP 2, TP 2 x PP 2; 14 recorded steps each): within 2 units as often as t says, beyond
4 units 3-10 times as often, and one isolated deviation of 7.8 units (a norm weight's update at
step 2 of TP 2 x PP 2) where t's family-wise threshold was 5.95. The threshold is t's times this
factor; docs/protocol_measurements.md (Fingerprints as evidence, measured) has the calibration."""
FLOOR = 1e-3  # a deviation below a quarter of bfloat16's rounding error is never evidence
DOF_EFFICIENCY = 0.75
"""The t tail with the combined degrees of freedom understates the tail of a difference over a
unit that is a product of two estimates: simulated with this estimator (K 4, S 6, 39 entries),
|z| > 4 and > 5 happened 16% and 29% more often than t gives. Plans of two correct sets (132
entries x 6 steps) then failed in 1.5% of 1,500 simulated plans for a nominal 1%; with 0.85 of the
degrees of freedom in 0.9%, with 0.7 in 0.3%; 0.75 keeps a margin under 1%
(tests/protocol/test_fingerprint_evidence.py measures it)."""

Key = tuple[str, str]  # (quantity, entry)
Relative = Mapping[Key, float]  # relative differences from the control at one step


@dataclass(frozen=True)
class NoiseModel:
    """The family's units: growth[(quantity, step)] = g, share[(quantity, entry)] = a."""

    growth: dict[tuple[str, int], float]
    share: dict[Key, float]
    members: int  # the family: the control and its noise controls
    entries: dict[str, int]  # per quantity

    @property
    def steps(self) -> int:
        return len({step for _, step in self.growth})

    def dof(self, quantity: str) -> float:
        """Degrees of freedom of the unit of an entry of `quantity`."""
        k = max(self.members - 1, 1)
        combined = 1 / (1 / (k * max(self.steps, 1)) + 1 / (k * max(self.entries.get(quantity, 1), 1)))
        return DOF_EFFICIENCY * combined

    def unit(self, key: Key, step: int) -> float:
        """The standard deviation of a correct set's relative difference from the family mean
        (0 when the family never moved this entry)."""
        spread = self.share.get(key, 0.0) * self.growth.get((key[0], step), 0.0)
        return spread * math.sqrt(1 + 1 / max(self.members, 1))


def fit_noise(spread: Mapping[int, list[Relative]]) -> NoiseModel:
    """The units from the family members' relative differences from the family's mean: step ->
    one mapping per member (the control and each noise control)."""
    members = max((len(m) for m in spread.values()), default=0)
    k = max(members - 1, 1)  # the mean took one degree of freedom
    growth, entries = {}, {}
    for step, rows in spread.items():
        squares: dict[str, list[float]] = {}
        for relative in rows:
            for (quantity, _), value in relative.items():
                squares.setdefault(quantity, []).append(value * value)
        for quantity, values in squares.items():
            growth[(quantity, step)] = math.sqrt(sum(values) / (k * len(values) / len(rows)))
            entries[quantity] = max(entries.get(quantity, 0), len(values) // len(rows))
    ratios: dict[Key, list[float]] = {}
    for step, rows in spread.items():
        for relative in rows:
            for key, value in relative.items():
                scale = growth.get((key[0], step), 0.0)
                if scale > 0:
                    ratios.setdefault(key, []).append(value / scale)
    share = {key: math.sqrt(sum(v * v for v in values) / (k * len(values) / members)) for key, values in ratios.items()}
    return NoiseModel(growth, share, members, entries)


def family_threshold(comparisons: int, dof: float, false_fail: float = FALSE_FAIL) -> float:
    """The |difference| / unit beyond which an entry deviates, so that `comparisons` correct ones
    exceed it together with probability at most false_fail: the t quantile for draws like the
    noise controls', widened by LAYOUT_TAILS for what correct layouts do beyond them."""
    return LAYOUT_TAILS * t_quantile(1 - false_fail / (2 * max(comparisons, 1)), dof)


def score(relative: float, unit: float, threshold: float) -> float:
    """The difference in units of what would be evidence: > 1 deviates."""
    return abs(relative) / max(threshold * unit, FLOOR)
