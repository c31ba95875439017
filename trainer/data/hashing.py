"""Hashes the data pipeline draws its randomness from: counter-based, so any row, position or
document gets its value on its own, the same on every rank and in every run."""

from __future__ import annotations

import hashlib

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a well-mixed 64-bit hash, vectorized (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x + GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def to_unit(x: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from the top 53 bits."""
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def document_unit(text: str) -> float:
    """A document's place in [0, 1), from its text alone: the validation split takes the
    documents below the held-out fraction, so adding, removing, renaming or reordering files
    never moves a document from one split to the other."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))
