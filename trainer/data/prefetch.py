"""[training.dataloader] / [validation.dataloader]: the rows of the coming global batches, computed
ahead in worker processes (torch's DataLoader) for a source that reads any row at any time (files,
shards, the built-in sources; a stream reads ahead in its own tokenizer workers).

Item k of the workers' sequence is this rank's rows of the global batch that starts k global
batches after the first row asked for: the same rows the training process would read itself, in
the same order, so a run's batches, its layout invariance and its exact resume do not depend on
the workers. Asking for another row than the next one (a resume, validation starting over)
starts the sequence again from it.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class _RowsAhead(Dataset):
    """Item k: `count` rows from row first + k x stride + offset, `length` tokens each."""

    def __init__(self, source, first: int, stride: int, offset: int, count: int, length: int):
        self.source, self.first, self.stride, self.offset = source, first, stride, offset
        self.count, self.length = count, length

    def __getitem__(self, k: int) -> torch.Tensor:
        start = self.first + k * self.stride + self.offset
        return torch.from_numpy(np.ascontiguousarray(self.source.rows(start, self.count, self.length)))


class _Endless:
    """0, 1, 2, ...: the workers' indices (a training run has no last batch)."""

    def __iter__(self):
        return itertools.count()


class RowPrefetcher:
    def __init__(self, source, options, *, stride: int, offset: int, count: int, length: int):
        self.source, self.options = source, options
        self.stride, self.offset, self.count, self.length = stride, offset, count, length
        self.loader, self.iterator, self.next_first = None, None, None

    def rows(self, first: int) -> torch.Tensor:
        """This rank's rows of the global batch starting at row `first`."""
        if self.iterator is None or first != self.next_first:
            self._start(first)
        self.next_first = first + self.stride
        return next(self.iterator)

    def _start(self, first: int) -> None:
        o = self.options
        if self.loader is None or self.loader.dataset.first != first or not o.persistent_workers:
            self.close()
            self.loader = DataLoader(
                _RowsAhead(self.source, first, self.stride, self.offset, self.count, self.length), batch_size=None,
                sampler=_Endless(), num_workers=o.num_workers, prefetch_factor=o.prefetch_factor,
                persistent_workers=o.persistent_workers, pin_memory=o.pin_memory and torch.cuda.is_available())
        self.iterator = iter(self.loader)

    def close(self) -> None:
        """End the workers now (they end with the process too)."""
        for iterator in (self.iterator, getattr(self.loader, "_iterator", None)):
            if hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self.iterator = self.loader = None
