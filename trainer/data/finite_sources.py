"""Finite token sources with random access: documents tokenized in memory (`files`) and
pre-tokenized shards read from disk as needed (`shards`).

A split's documents, each [BOS] text [EOS], are concatenated in a fixed order and cut into
sequences of `length` tokens (non-overlapping; the tail shorter than one sequence is not read).
Epoch e reads all of them once, in the order of a seeded permutation of (data seed, e)
(trainer.data.shuffle), or in file order when shuffling is off. Global row g is therefore
sequence permute(g mod n, n, seed, g div n): a function of the data, the seed and the row length
alone, whatever the parallel layout.
"""

from __future__ import annotations

import hashlib

import numpy as np

from trainer.data.documents import DataError
from trainer.data.shards import ShardSet
from trainer.data.shuffle import permute


class DataExhausted(RuntimeError):
    """A finite dataset ended and the configuration says to stop rather than wrap around."""


class FiniteTokenSource:
    """Rows of a finite token sequence, epoch after epoch. Subclasses provide `token_count` and
    `_read(start, stop)`."""

    random_access = True
    entropy_floor = None

    def __init__(self, *, name: str, wrap: bool, shuffle_seed: int | None, eos_id: int | None = None):
        self.name, self.wrap, self.shuffle_seed = name, wrap, shuffle_seed
        self.eos_id = eos_id  # the token that ends each document (None: unknown)

    token_count: int

    def _read(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def rows_per_epoch(self, length: int) -> int:
        return self.token_count // length

    def epoch_of(self, row: int, length: int) -> int:
        return row // max(self.rows_per_epoch(length), 1)

    def check_available(self, last_row: int, length: int) -> None:
        """DataError when the data holds no whole row; DataExhausted when `last_row` is past the
        end and the source does not wrap."""
        per_epoch = self.rows_per_epoch(length)
        if per_epoch == 0:
            raise DataError(f"{self.name}: {self.token_count} tokens, fewer than one sequence of {length}")
        if not self.wrap and last_row >= per_epoch:
            raise DataExhausted(f"{self.name}: the dataset ends after {per_epoch} sequences of {length} tokens "
                                f"(training.dataset_end = 'stop')")

    def sequence_indices(self, first_row: int, count: int, length: int) -> np.ndarray:
        """Which sequence of the concatenation each global row reads."""
        per_epoch = self.rows_per_epoch(length)
        rows = np.arange(first_row, first_row + count, dtype=np.int64)
        if self.shuffle_seed is None:
            return rows % per_epoch
        out = np.empty(count, dtype=np.int64)
        epochs = rows // per_epoch
        for epoch in np.unique(epochs):  # a batch spans at most a few epochs
            here = epochs == epoch
            out[here] = permute(rows[here] % per_epoch, per_epoch, self.shuffle_seed, int(epoch))
        return out

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        self.check_available(first_row + count - 1, length)
        starts = self.sequence_indices(first_row, count, length) * length
        return np.stack([self._read(int(s), int(s) + length) for s in starts]) if count else \
            np.zeros((0, length), dtype=np.int64)

    def fingerprint(self) -> dict:
        return {"source": self.name, "tokens": self.token_count, "shuffle_seed": self.shuffle_seed}


class TokenArraySource(FiniteTokenSource):
    """A token array in memory (local files tokenized at start, or a test's own tokens)."""

    def __init__(self, tokens: np.ndarray, *, name: str, wrap: bool = True, shuffle_seed: int | None = None,
                 eos_id: int | None = None, skipped_records: int = 0):
        super().__init__(name=name, wrap=wrap, shuffle_seed=shuffle_seed, eos_id=eos_id)
        self.tokens = tokens
        self.skipped_records = skipped_records  # records without text, for the run record
        self.token_count = len(tokens)

    def _read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].astype(np.int64)

    def fingerprint(self) -> dict:
        digest = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes()).hexdigest()
        return {**super().fingerprint(), "tokens_sha256": digest}

    def describe(self) -> dict:
        return {"source": self.name, "tokens": int(self.token_count), "shuffle_seed": self.shuffle_seed,
                "skipped_records": self.skipped_records}


class ShardSource(FiniteTokenSource):
    """A split of a prepared shard folder, read sequence by sequence from disk. name: what the
    run record and messages call it (default: shards:<folder>:<split>); identity: flat fields
    added to its description and fingerprint (a built-in corpus's version and digest, which
    stay the same wherever its cache folder is)."""

    def __init__(self, folder: str, split: str, *, wrap: bool = True, shuffle_seed: int | None = None,
                 key: str = "training.dataset_path", name: str = "", identity: dict | None = None):
        self.shards = ShardSet(folder, split, key)
        super().__init__(name=name or f"shards:{folder}:{split}", wrap=wrap, shuffle_seed=shuffle_seed,
                         eos_id=self.shards.manifest["tokenizer"]["eos_id"])
        self.token_count = self.shards.token_count
        self.identity = identity or {}

    def _read(self, start: int, stop: int) -> np.ndarray:
        return self.shards.tokens(start, stop)

    def fingerprint(self) -> dict:
        return {**super().fingerprint(), "digest": self.shards.manifest["digest"], "split": self.shards.split,
                **self.identity}

    def describe(self) -> dict:
        return {"source": self.name, **self.shards.describe(), "shuffle_seed": self.shuffle_seed, **self.identity}
