"""Token sources. A source maps a global row index to a fixed sequence of token ids.

Because a row depends only on (source, seed, row index, length), every parallel layout and every
resumed run reads exactly the same tokens (ARCHITECTURE invariant 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticMarkovSource:
    """A seeded sparse random Markov chain over the vocabulary with a known entropy rate.

    Every state has `branching` distinct successors; the successor in slot j is taken with
    probability p_j, the same Zipf-like distribution for every state. So, whatever the state, the
    next token has entropy H(p): the best achievable cross-entropy is exactly H(p) nats per token,
    and a model's loss can be judged against it. The walk for a row needs one table lookup per
    token, which keeps generation far faster than training.
    """

    vocab_size: int
    seed: int
    branching: int = 16
    zipf_exponent: float = 1.2

    def __post_init__(self) -> None:
        if self.vocab_size <= self.branching:
            raise ValueError(f"synthetic source: vocab_size {self.vocab_size} must exceed branching {self.branching}")
        rng = np.random.default_rng([self.seed, 0x5EED])
        object.__setattr__(self, "successors", self._successor_table(rng))
        weights = 1.0 / np.arange(1, self.branching + 1) ** self.zipf_exponent
        object.__setattr__(self, "slot_probs", weights / weights.sum())

    def _successor_table(self, rng: np.random.Generator) -> np.ndarray:
        """(vocab, branching) table of distinct successor states for each state."""
        v, k = self.vocab_size, self.branching
        table = rng.integers(0, v, size=(v, k))
        while True:  # redraw the (rare) rows that repeat a successor
            sorted_rows = np.sort(table, axis=1)
            bad = np.nonzero((sorted_rows[:, 1:] == sorted_rows[:, :-1]).any(axis=1))[0]
            if bad.size == 0:
                return table
            table[bad] = rng.integers(0, v, size=(bad.size, k))

    @property
    def entropy_floor(self) -> float:
        """Best achievable mean cross-entropy per predicted token, in nats."""
        p = self.slot_probs
        return float(-(p * np.log(p)).sum())

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        """Rows first_row .. first_row+count-1 of the infinite token stream, each `length` long."""
        starts = np.empty(count, dtype=np.int64)
        slots = np.empty((count, length - 1), dtype=np.int64)
        for i in range(count):
            rng = np.random.default_rng([self.seed, first_row + i])
            starts[i] = rng.integers(0, self.vocab_size)
            slots[i] = rng.choice(self.branching, size=length - 1, p=self.slot_probs)
        tokens = np.empty((count, length), dtype=np.int64)
        tokens[:, 0] = starts
        current = starts
        for t in range(1, length):
            current = self.successors[current, slots[:, t - 1]]
            tokens[:, t] = current
        return tokens

    def describe(self) -> dict:
        return {
            "source": "synthetic",
            "vocab_size": self.vocab_size,
            "seed": self.seed,
            "branching": self.branching,
            "entropy_floor_nats": self.entropy_floor,
            "entropy_floor_bits": self.entropy_floor / math.log(2),
        }


def build_source(dataset: str, *, vocab_size: int, seed: int) -> SyntheticMarkovSource:
    if dataset == "synthetic":
        return SyntheticMarkovSource(vocab_size=vocab_size, seed=seed)
    raise ValueError(f"training.dataset: {dataset!r} is not available; choose 'synthetic'")
