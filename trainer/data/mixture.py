"""A weighted mixture of finite sources, deterministic and the same in every layout.

The global row stream is cut into blocks of BLOCK rows. Each block gives source k exactly n_k of
its rows (n_k = BLOCK * w_k / sum(w), rounded so that they add up), in a fixed interleaved order:
the schedule, built once from the weights by smooth weighted round robin, so that every stretch
of rows (every global batch) holds each source's share to within one row. Global row g = b*BLOCK + s is then
row b*n_k + (rank of slot s among source k's slots) of source k = schedule[s]: any row's source
and place are computed on their own, and consecutive rows of one source are consecutive in it,
so each source is read, shuffled and wrapped exactly as when it is trained on alone.
"""

from __future__ import annotations

import numpy as np

BLOCK = 10_000


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Rows per block for each source: proportional to the weights, adding up to `block`
    (largest remainders get the rounding)."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights) * block
    counts = np.floor(shares).astype(np.int64)
    for index in np.argsort(counts - shares)[: block - counts.sum()]:  # largest remainders first
        counts[index] += 1
    return counts


def block_schedule(counts: np.ndarray) -> np.ndarray:
    """Which source each slot of a block reads, spread as evenly as the counts allow."""
    total = int(counts.sum())
    credit = np.zeros(len(counts), dtype=np.int64)
    schedule = np.empty(total, dtype=np.int64)
    for slot in range(total):  # smooth weighted round robin
        credit += counts
        chosen = int(np.argmax(credit))
        credit[chosen] -= total
        schedule[slot] = chosen
    return schedule


class MixtureSource:
    """Rows drawn from several finite sources (each with rows / check_available / epoch_of)."""

    random_access = True
    entropy_floor = None

    def __init__(self, sources: list, names: list[str], weights: list[float], *, block: int = BLOCK):
        self.sources, self.names, self.weights = sources, names, weights
        self.counts = block_counts(weights, block)
        self.schedule = block_schedule(self.counts)
        self.block = block
        # rank[s]: how many earlier slots of the block belong to the same source as slot s.
        self.rank = np.zeros(block, dtype=np.int64)
        seen = np.zeros(len(sources), dtype=np.int64)
        for slot, source in enumerate(self.schedule):
            self.rank[slot], seen[source] = seen[source], seen[source] + 1
        self.name = "mixture:" + ",".join(names)

    @property
    def eos_id(self) -> int | None:
        """The parts' common EOS id (None when they differ or one is unknown)."""
        ids = {source.eos_id for source in self.sources}
        return ids.pop() if len(ids) == 1 else None

    def rows_drawn(self, rows: int) -> np.ndarray:
        """How many rows each source gave to the first `rows` global rows."""
        blocks, rest = divmod(rows, self.block)
        return blocks * self.counts + np.bincount(self.schedule[:rest], minlength=len(self.sources))

    def _locate(self, first_row: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.arange(first_row, first_row + count, dtype=np.int64)
        blocks, slots = np.divmod(rows, self.block)
        sources = self.schedule[slots]
        return sources, blocks * self.counts[sources] + self.rank[slots]

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        sources, local = self._locate(first_row, count)
        out = np.empty((count, length), dtype=np.int64)
        for index, source in enumerate(self.sources):
            here = np.nonzero(sources == index)[0]
            if here.size:  # consecutive rows of this source
                out[here] = source.rows(int(local[here[0]]), int(here.size), length)
        return out

    def check_available(self, last_row: int, length: int) -> None:
        for source, drawn in zip(self.sources, self.rows_drawn(last_row + 1)):
            if drawn:
                source.check_available(int(drawn) - 1, length)

    def epoch_of(self, row: int, length: int) -> int:
        """The largest epoch any source is in (the mixture's 'epoch' for the log)."""
        drawn = self.rows_drawn(row + 1)
        return max(source.epoch_of(max(int(d) - 1, 0), length) for source, d in zip(self.sources, drawn))

    def rows_per_epoch(self, length: int) -> int:
        return min(source.rows_per_epoch(length) for source in self.sources)

    def fingerprint(self) -> dict:
        return {"source": self.name, "weights": list(self.weights),
                "parts": [source.fingerprint() for source in self.sources]}

    def describe(self) -> dict:
        return {"source": self.name, "parts": [{"name": name, "weight": weight, **source.describe()}
                                                for name, weight, source in zip(self.names, self.weights, self.sources)]}
