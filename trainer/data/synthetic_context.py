"""A built-in synthetic source on which attention and positions matter: `synthetic_context`.

The Markov source (trainer.data.synthetic) is first order: the next token depends on the current
one only, which every position already holds, so a bug in attention or in the positions RoPE
gives it (a context-parallel rank rotating its chunk from position 0, say) cannot change training
on it. This source mixes three kinds of token, so that the best prediction needs earlier context
at known distances and the position in the row:

* markers: at every position t = k x marker_period (k >= 1) the token is marker (k - 1) mod
  markers, one of `markers` token ids kept for them (the highest ids of the vocabulary). It
  depends only on t: a model must know where it is in the row, or find the previous marker
  `marker_period` tokens back, to predict it;
* copies: elsewhere, with probability copy_probs[i] the token repeats the one lags[i] positions
  earlier (when the row is that long), so a model gains by attending to those exact distances;
* the Markov chain otherwise: a sparse random chain over the other ids, as in the Markov
  source, continued from whatever token came before (a copy or a marker included).

Each row is one document that starts at position 0 (no end-of-document tokens). Like every
source, row r is a pure function of (seed, split, r, length), so every layout and every resumed
run reads the same tokens. The best achievable loss (the entropy of the true next-token
distribution, averaged over a row's predicted positions) depends on the row length; it is
estimated by Monte Carlo from about FLOOR_TOKENS tokens of the true conditional probabilities
(entropy_floor_for), with its standard error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from trainer.data.hashing import GOLDEN, splitmix64, to_unit
from trainer.data.synthetic import SPLIT_IDS

FLOOR_TOKENS = 1 << 20  # the floor's Monte Carlo sample: ~1M tokens (2048 rows of 512), at most 2048 rows
DEFAULT_ROW_LENGTH = 129  # seq_len 128 + 1, the debug model's
_SLOT_STREAM = np.uint64(0xA5A5_5A5A_C3C3_3C3C)  # a second, independent uniform per position
_FLOOR_SPLIT = "floor"  # rows the floor is estimated from: neither split's


@dataclass(frozen=True)
class SyntheticContextSource:
    """Markers at fixed positions, copies at fixed distances and a Markov chain between them."""

    vocab_size: int
    seed: int
    split: str = "train"
    row_length: int = DEFAULT_ROW_LENGTH
    """The row length the stated floor is for (seq_len + 1); rows of any length can be read."""
    lags: tuple[int, ...] = (4,)
    copy_probs: tuple[float, ...] = (0.5,)
    marker_period: int = 12
    markers: int = 4
    branching: int = 4
    zipf_exponent: float = 1.2
    random_access = True
    eos_id = None  # one document per row
    successors: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chain_vocab = self.vocab_size - self.markers
        if chain_vocab <= self.branching:
            raise ValueError(f"synthetic_context source: vocab_size {self.vocab_size} must exceed branching "
                             f"{self.branching} + markers {self.markers}")
        if len(self.lags) != len(self.copy_probs) or sum(self.copy_probs) >= 1 or min(self.lags) < 2:
            raise ValueError("synthetic_context source: one copy probability per lag, lags >= 2, probabilities "
                             "summing below 1")
        rng = np.random.default_rng([self.seed, 0xC0_47E7])
        object.__setattr__(self, "successors", self._successor_table(rng, chain_vocab))
        weights = 1.0 / np.arange(1, self.branching + 1) ** self.zipf_exponent
        object.__setattr__(self, "slot_probs", weights / weights.sum())
        object.__setattr__(self, "_cumulative", np.cumsum(self.slot_probs))

    def _successor_table(self, rng: np.random.Generator, chain_vocab: int) -> np.ndarray:
        """(vocab, branching) distinct successors per state, all outside the marker ids (a
        marker is a state too: the chain goes on from it)."""
        table = rng.integers(0, chain_vocab, size=(self.vocab_size, self.branching))
        while True:
            sorted_rows = np.sort(table, axis=1)
            bad = np.nonzero((sorted_rows[:, 1:] == sorted_rows[:, :-1]).any(axis=1))[0]
            if bad.size == 0:
                return table
            table[bad] = rng.integers(0, chain_vocab, size=(bad.size, self.branching))

    @property
    def first_marker_id(self) -> int:
        return self.vocab_size - self.markers

    def marker_at(self, position: int) -> int | None:
        """The marker id position `position` holds, or None where it holds none."""
        if position == 0 or position % self.marker_period:
            return None
        return self.first_marker_id + (position // self.marker_period - 1) % self.markers

    def _copy_mass(self, position: int) -> list[tuple[int, float]]:
        """(lag, probability) of the copies possible at `position` (their source exists)."""
        return [(lag, p) for lag, p in zip(self.lags, self.copy_probs) if lag <= position]

    # ------------------------------------------------------------------ rows
    def _uniforms(self, split: str, first_row: int, count: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        key = splitmix64(np.array([self.seed * 1_000_003 + _split_id(split)], dtype=np.uint64))[0]
        row_keys = splitmix64(key + np.arange(first_row, first_row + count, dtype=np.uint64) * GOLDEN)
        counters = row_keys[:, None] + np.arange(length, dtype=np.uint64)
        return to_unit(splitmix64(counters)), to_unit(splitmix64(counters ^ _SLOT_STREAM))

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        """Rows first_row .. first_row+count-1, each `length` long (counter-based: see the module)."""
        return self._generate(self.split, first_row, count, length)

    def _generate(self, split: str, first_row: int, count: int, length: int) -> np.ndarray:
        event, slot_u = self._uniforms(split, first_row, count, length)
        slots = np.minimum(np.searchsorted(self._cumulative, slot_u, side="right"), self.branching - 1)
        tokens = np.empty((count, length), dtype=np.int64)
        tokens[:, 0] = (event[:, 0] * self.first_marker_id).astype(np.int64)
        flat = self.successors.ravel()
        for t in range(1, length):  # sequential: a copy or a step of the chain reads earlier tokens
            tokens[:, t] = flat[tokens[:, t - 1] * self.branching + slots[:, t]]
            low = 0.0
            for lag, p in self._copy_mass(t):
                copying = (event[:, t] >= low) & (event[:, t] < low + p)
                tokens[copying, t] = tokens[copying, t - lag]
                low += p
            marker = self.marker_at(t)
            if marker is not None:
                tokens[:, t] = marker
        return tokens

    # ------------------------------------------------------------------ the floor
    def true_log_probs(self, tokens: np.ndarray) -> np.ndarray:
        """log p(token t | tokens before it) under the generating process, for t >= 1: (rows, length - 1)."""
        rows, length = tokens.shape
        out = np.empty((rows, length - 1))
        for t in range(1, length):
            if self.marker_at(t) is not None:
                out[:, t - 1] = 0.0
                continue
            copies = self._copy_mass(t)
            match = self.successors[tokens[:, t - 1]] == tokens[:, t, None]  # (rows, branching)
            chain = (match * self.slot_probs).sum(axis=1)
            prob = (1 - sum(p for _, p in copies)) * chain
            for lag, p in copies:
                prob = prob + p * (tokens[:, t - lag] == tokens[:, t])
            out[:, t - 1] = np.log(prob)
        return out

    def entropy_floor_for(self, row_length: int) -> tuple[float, float]:
        """(best achievable mean loss in nats over the predicted positions of rows of `row_length`,
        its Monte Carlo standard error), from about FLOOR_TOKENS tokens in rows drawn apart from both splits."""
        return _floor(self, row_length)

    @property
    def entropy_floor(self) -> float:
        """Best achievable mean loss per predicted token for rows of row_length (Monte Carlo)."""
        return self.entropy_floor_for(self.row_length)[0]

    @property
    def markov_floor(self) -> float:
        """The chain's own entropy rate: the floor were every token a step of the chain."""
        p = self.slot_probs
        return float(-(p * np.log(p)).sum())

    def check_available(self, last_row: int, length: int) -> None:
        """Every row exists: the stream is endless."""

    def epoch_of(self, row: int, length: int) -> int:
        return 0

    def describe(self) -> dict:
        floor, stderr = self.entropy_floor_for(self.row_length)
        return {
            "source": "synthetic_context", "split": self.split, "vocab_size": self.vocab_size, "seed": self.seed,
            "lags": list(self.lags), "copy_probs": list(self.copy_probs), "marker_period": self.marker_period,
            "markers": self.markers, "branching": self.branching,
            "entropy_floor_nats": floor, "entropy_floor_stderr": stderr, "entropy_floor_bits": floor / math.log(2),
            "entropy_floor_row_length": self.row_length, "markov_entropy_nats": self.markov_floor,
        }

    def fingerprint(self) -> dict:
        return {"source": "synthetic_context", "split": self.split, "vocab_size": self.vocab_size, "seed": self.seed}


def _split_id(split: str) -> int:
    return SPLIT_IDS.get(split, len(SPLIT_IDS))


@lru_cache(maxsize=16)
def _floor(source: SyntheticContextSource, row_length: int) -> tuple[float, float]:
    rows = max(64, min(2048, FLOOR_TOKENS // row_length))
    tokens = source._generate(_FLOOR_SPLIT, 0, rows, row_length)
    per_row = -source.true_log_probs(tokens).mean(axis=1)
    return float(per_row.mean()), float(per_row.std(ddof=1) / math.sqrt(len(per_row)))
