"""The built-in synthetic source: a seeded random Markov chain with a known best loss.

Like every source (see trainer.data.build), it maps a global row index to a fixed sequence of
token ids, so every parallel layout and every resumed run reads exactly the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer.data.hashing import GOLDEN, splitmix64, to_unit

SPLIT_IDS = {"train": 0, "validation": 1}


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
    split: str = "train"
    branching: int = 16
    zipf_exponent: float = 1.2
    random_access = True
    eos_id = None  # no documents

    def __post_init__(self) -> None:
        if self.vocab_size <= self.branching:
            raise ValueError(f"synthetic source: vocab_size {self.vocab_size} must exceed branching {self.branching}")
        rng = np.random.default_rng([self.seed, 0x5EED])
        object.__setattr__(self, "successors", self._successor_table(rng))
        weights = 1.0 / np.arange(1, self.branching + 1) ** self.zipf_exponent
        object.__setattr__(self, "slot_probs", weights / weights.sum())
        object.__setattr__(self, "_cumulative", np.cumsum(self.slot_probs))
        key = splitmix64(np.array([self.seed * 1_000_003 + SPLIT_IDS[self.split]], dtype=np.uint64))[0]
        object.__setattr__(self, "_key", key)

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
        """Rows first_row .. first_row+count-1 of the infinite token stream, each `length` long.

        The randomness of row r, position t is a counter-based hash of (seed, split, r, t), so any
        row is computed on its own and a whole batch is drawn with a few vectorized operations.
        """
        row_keys = splitmix64(self._key + np.arange(first_row, first_row + count, dtype=np.uint64) * GOLDEN)
        uniform = to_unit(splitmix64(row_keys[:, None] + np.arange(length, dtype=np.uint64)))
        slots = np.minimum(np.searchsorted(self._cumulative, uniform[:, 1:], side="right"), self.branching - 1)
        tokens = np.empty((count, length), dtype=np.int64)
        current = (uniform[:, 0] * self.vocab_size).astype(np.int64)
        tokens[:, 0] = current
        flat = self.successors.ravel()
        for t in range(1, length):  # the walk itself is sequential; one gather per position
            current = flat[current * self.branching + slots[:, t - 1]]
            tokens[:, t] = current
        return tokens

    def check_available(self, last_row: int, length: int) -> None:
        """Every row exists: the stream is endless."""

    def epoch_of(self, row: int, length: int) -> int:
        return 0  # an endless stream

    def describe(self) -> dict:
        return {
            "source": "synthetic",
            "split": self.split,
            "vocab_size": self.vocab_size,
            "seed": self.seed,
            "branching": self.branching,
            "entropy_floor_nats": self.entropy_floor,
            "entropy_floor_bits": self.entropy_floor / math.log(2),
        }

    def fingerprint(self) -> dict:
        return {"source": "synthetic", "split": self.split, "vocab_size": self.vocab_size, "seed": self.seed}
