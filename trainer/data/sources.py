"""Token sources. A source maps a global row index to a fixed sequence of token ids.

Because a row depends only on (source, seed, row index, length), every parallel layout and every
resumed run reads exactly the same tokens (ARCHITECTURE invariant 1).

Every source has `rows(first_row, count, length) -> int64 array (count, length)`, `describe()`,
`entropy_floor` (the best achievable loss, or None when unknown) and `random_access` (False: rows
must be read in order, and the source carries a state_dict). Random-access sources also have
`check_available(last_row, length)`, which raises DataExhausted past the end of a finite source
that does not wrap (the loader asks it for the last row of each global batch). The built-in synthetic source lives
here; text sources (local files, Hugging Face) in text_sources.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SPLIT_IDS = {"train": 0, "validation": 1}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a well-mixed 64-bit hash, vectorized (uint64 arithmetic wraps)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _to_unit(x: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from the top 53 bits."""
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


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

    def __post_init__(self) -> None:
        if self.vocab_size <= self.branching:
            raise ValueError(f"synthetic source: vocab_size {self.vocab_size} must exceed branching {self.branching}")
        rng = np.random.default_rng([self.seed, 0x5EED])
        object.__setattr__(self, "successors", self._successor_table(rng))
        weights = 1.0 / np.arange(1, self.branching + 1) ** self.zipf_exponent
        object.__setattr__(self, "slot_probs", weights / weights.sum())
        object.__setattr__(self, "_cumulative", np.cumsum(self.slot_probs))
        key = _splitmix64(np.array([self.seed * 1_000_003 + SPLIT_IDS[self.split]], dtype=np.uint64))[0]
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
        row_keys = _splitmix64(self._key + np.arange(first_row, first_row + count, dtype=np.uint64) * _GOLDEN)
        uniform = _to_unit(_splitmix64(row_keys[:, None] + np.arange(length, dtype=np.uint64)))
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


HOLDOUT_EVERY = 20  # files without a validation path: every 20th document is held out


def build_source(dataset: str, dataset_path: str, *, split: str, vocab_size: int, seed: int, tokenizer,
                 text_field: str, wrap: bool, holdout: bool):
    """The token source of one split.

    holdout: the training split leaves out what the validation split takes (only matters for
    local files, whose validation documents come out of the same files).
    """
    from trainer.data import text_sources as text

    if dataset == "synthetic":
        return SyntheticMarkovSource(vocab_size=vocab_size, seed=seed, split=split)
    if tokenizer is None:
        raise text.DataError(f"training.dataset {dataset!r} is text: set model.tokenizer_path to a SentencePiece "
                             "model (train one with `python -m trainer.data.tokenizer train`)")
    if dataset == "files":
        if not dataset_path:
            raise text.DataError("training.dataset_path: required for dataset 'files' (a file, folder or glob)")
        documents = text.read_documents(text.find_data_files(dataset_path), text_field)
        if holdout:
            keep_validation = split == "validation"
            documents = [d for i, d in enumerate(documents)
                         if (i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1) == keep_validation]
        if not documents:
            raise text.DataError(f"training.dataset_path: {dataset_path!r} holds no {split} documents")
        tokens = text.tokenize_documents(documents, tokenizer)
        return text.TokenArraySource(tokens, name=f"files:{dataset_path}:{split}", wrap=wrap)
    opener = text.hub_stream_opener(dataset, dataset_path, split)
    return text.StreamingTextSource(opener, tokenizer, text_field=text_field, name=f"{dataset}:{split}", wrap=wrap)


def build_sources(config, vocab_size: int):
    """(training source, validation source or None) for a JobConfig."""
    tokenizer = None
    if config.model.tokenizer_path:
        from trainer.data.tokenizer import Tokenizer, check_vocab_fits

        tokenizer = Tokenizer(config.model.tokenizer_path)
        check_vocab_fits(tokenizer, vocab_size)
    t, v = config.training, config.validation
    separate_validation = bool(v.dataset)
    common = dict(vocab_size=vocab_size, seed=config.debug.seed, tokenizer=tokenizer, text_field=t.dataset_text_field)
    train = build_source(t.dataset, t.dataset_path, split="train", wrap=t.dataset_end == "wrap",
                         holdout=v.enable and not separate_validation, **common)
    if not v.enable:
        return train, None
    if separate_validation:
        validation = build_source(v.dataset, v.dataset_path, split="validation", wrap=True, holdout=False, **common)
    else:
        validation = build_source(t.dataset, t.dataset_path, split="validation", wrap=True, holdout=True, **common)
    return train, validation
