"""Seeded permutations of row indices that need no memory and no set-up.

A finite source of n rows is read epoch by epoch; in epoch e, position p is physical row
`permute(p, n, seed, e)`. The permutation is a keyed Feistel network on the smallest power-of-four
domain holding n, walked back into [0, n) (cycle walking): a bijection of [0, n) computed row by
row, so any rank computes any row's place without building (or holding) the whole order, and a
corpus of billions of rows costs nothing at start. It depends only on (n, seed, epoch): the same
in every parallel layout, a new order every epoch.
"""

from __future__ import annotations

import numpy as np

from trainer.data.hashing import splitmix64

ROUNDS = 6


def _round_keys(seed: int, epoch: int) -> np.ndarray:
    base = splitmix64(np.array([seed & (2**63 - 1)], dtype=np.uint64))[0] ^ np.uint64(epoch * 0x632BE59BD9B4E019 % 2**64)
    return splitmix64(base + np.arange(1, ROUNDS + 1, dtype=np.uint64))


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The physical rows of `positions` (values in [0, n)) in epoch `epoch`'s order."""
    positions = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return positions.astype(np.int64)
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    keys = _round_keys(seed, epoch)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (splitmix64(right ^ key) & mask)
        return (left << shift) | right

    out = encrypt(positions)
    outside = out >= np.uint64(n)
    while outside.any():  # the domain is < 4n, so each walk takes a few rounds on average
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
