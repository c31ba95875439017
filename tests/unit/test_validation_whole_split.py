"""validation.steps = -1: every sequence of a finite validation split once, whatever the layout."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from trainer.data.documents import DataError
from trainer.data.finite_sources import TokenArraySource
from trainer.data.loader import BatchLoader, evaluation_batches
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.loss import IGNORE_INDEX

SEQ = 8


def split(sequences: int, extra_tokens: int = 3) -> TokenArraySource:
    """A validation split of `sequences` whole sequences (rows of SEQ + 1 tokens) and a shorter tail."""
    tokens = np.arange(sequences * (SEQ + 1) + extra_tokens, dtype=np.int32)
    return TokenArraySource(tokens, name="files:v:validation")


def loaders(source, *, dp: int, global_batch: int, local_batch: int) -> list[BatchLoader]:
    return [BatchLoader(source, seq_len=SEQ, global_batch_size=global_batch, local_batch_size=local_batch,
                        dp_rank=rank, dp_degree=dp, device=torch.device("cpu"), name="validation", pad_uneven=True)
            for rank in range(dp)]


def evaluated_rows(source, **layout) -> tuple[list[int], int, set[int]]:
    """(first token of every sequence that counts, in order read; batches; microbatches per rank per batch)."""
    ranks = loaders(source, **layout)
    batches = {evaluation_batches(loader, -1) for loader in ranks}
    assert len(batches) == 1
    counted, microbatch_counts = [], set()
    for _ in range(batches.pop()):
        for loader in ranks:
            microbatches = loader.next_batch()
            microbatch_counts.add(len(microbatches))
            for inputs, labels in microbatches:
                for row_inputs, row_labels in zip(inputs, labels):
                    if (row_labels != IGNORE_INDEX).any():
                        assert (row_labels != IGNORE_INDEX).all()  # a sequence counts whole, or not at all
                        counted.append(int(row_inputs[0]))
                    else:
                        assert not row_inputs.any()  # padding
    return counted, len(counted), microbatch_counts


@pytest.mark.parametrize("dp, global_batch, local_batch", [(1, 4, 2), (2, 4, 2), (2, 6, 2), (4, 4, 1), (3, 8, 2)])
def test_every_sequence_is_evaluated_once_in_every_layout(dp, global_batch, local_batch):
    source = split(13)
    counted, total, microbatch_counts = evaluated_rows(source, dp=dp, global_batch=global_batch,
                                                       local_batch=local_batch)
    assert sorted(counted) == [row * (SEQ + 1) for row in range(13)]  # each of the 13 sequences once
    assert total == 13
    assert len(microbatch_counts) == 1  # every rank runs the same number of forward passes


def test_the_batches_and_the_split_are_logged(caplog):
    [loader] = loaders(split(13), dp=1, global_batch=4, local_batch=2)
    with caplog.at_level(logging.INFO, logger="trainer.data.loader"):
        assert evaluation_batches(loader, -1) == 4
    assert ("validation data: one evaluation reads the whole split (validation.steps = -1): 13 sequences of 8 tokens "
            "in 4 batches of 4") in caplog.text


def test_each_evaluation_reads_the_split_again_from_its_start():
    [loader] = loaders(split(5), dp=1, global_batch=4, local_batch=2)
    batches = evaluation_batches(loader, -1)
    first = [loader.next_batch() for _ in range(batches)]
    loader.reset()
    again = [loader.next_batch() for _ in range(batches)]
    for a, b in zip(first, again):
        for (ia, la), (ib, lb) in zip(a, b):
            assert torch.equal(ia, ib) and torch.equal(la, lb)


def test_a_number_of_steps_is_unchanged():
    [loader] = loaders(split(13), dp=1, global_batch=4, local_batch=2)
    assert evaluation_batches(loader, 3) == 3 and loader.end_row is None


def test_an_endless_or_empty_split_is_refused():
    [loader] = loaders(SyntheticMarkovSource(vocab_size=64, seed=0, split="validation"), dp=1, global_batch=4,
                       local_batch=2)
    with pytest.raises(DataError, match="validation.steps = -1: synthetic is not a finite split of known length"):
        evaluation_batches(loader, -1)
    [loader] = loaders(split(0), dp=1, global_batch=4, local_batch=2)
    with pytest.raises(DataError, match="the validation split is empty for this sequence length"):
        evaluation_batches(loader, -1)
