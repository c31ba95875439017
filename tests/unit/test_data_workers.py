"""[training.dataloader] workers (trainer/data/prefetch.py): the same rows in the same order as the
training process reads itself, in every data-parallel layout, across epochs, after a resume, for
validation starting over, and at the end of a finite source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainer.config.dataloader import DataLoader
from trainer.config.manager import ConfigError, load_config
from trainer.data.finite_sources import DataExhausted, TokenArraySource
from trainer.data.loader import BatchLoader

SEQ = 16
TOKENS = np.random.default_rng(0).integers(0, 500, size=20 * (SEQ + 1) + 7)  # 20 rows an epoch


def source(wrap: bool = True) -> TokenArraySource:
    return TokenArraySource(TOKENS, name="test tokens", wrap=wrap, shuffle_seed=4)


def ranks(dp: int, workers: int, wrap: bool = True, **options) -> list[BatchLoader]:
    return [BatchLoader(source(wrap), seq_len=SEQ, global_batch_size=8, local_batch_size=8 // dp, dp_rank=r,
                        dp_degree=dp, device=torch.device("cpu"), workers=DataLoader(num_workers=workers, **options))
            for r in range(dp)]


def global_batch(loaders: list[BatchLoader]) -> np.ndarray:
    return np.concatenate([torch.cat([i, l[:, -1:]], 1).numpy() for loader in loaders for i, l in loader.next_batch()])


def test_workers_read_the_rows_the_training_process_reads_in_every_layout_and_epoch():
    reference = ranks(1, 0)
    expected = [global_batch(reference) for _ in range(7)]  # 56 rows: nearly three epochs of 20
    for dp, workers in ((1, 2), (2, 1), (4, 2)):
        loaders = ranks(dp, workers, prefetch_factor=3)
        assert all(loader.prefetch is not None for loader in loaders)
        for step, rows in enumerate(expected):
            assert np.array_equal(global_batch(loaders), rows), (dp, workers, step)
        for loader in loaders:
            loader.close()
            assert loader.prefetch.loader is None


def test_a_resume_with_workers_continues_on_the_same_rows():
    uninterrupted = ranks(2, 0)
    expected = [global_batch(uninterrupted) for _ in range(6)]
    first = ranks(2, 2)
    for _ in range(3):
        global_batch(first)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in first]
    resumed = ranks(2, 2)
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    assert [global_batch(resumed).tolist() for _ in range(3)] == [rows.tolist() for rows in expected[3:]]


@pytest.mark.parametrize("persistent", [False, True])
def test_validation_starting_over_reads_the_same_batches(persistent):
    [loader] = ranks(1, 2, persistent_workers=persistent)
    first_pass = [global_batch([loader]) for _ in range(3)]
    kept = loader.prefetch.loader
    loader.reset()
    assert all(np.array_equal(global_batch([loader]), rows) for rows in first_pass)
    assert (loader.prefetch.loader is kept) == persistent  # persistent workers serve the next pass too


def test_a_finite_source_ends_at_the_same_batch_with_workers():
    for workers in (0, 2):
        [loader] = ranks(1, workers, wrap=False)
        for _ in range(2):
            global_batch([loader])
        with pytest.raises(DataExhausted):
            global_batch([loader])  # rows 16-23 of 20


@pytest.mark.parametrize("key", ["prefetch_factor 2", "persistent_workers true"])
@pytest.mark.parametrize("table", ["training", "validation"])
def test_worker_options_without_workers_are_refused(table, key):
    name, value = key.split()
    with pytest.raises(ConfigError, match=f"{table}.dataloader.{name}: needs {table}.dataloader.num_workers > 0"):
        load_config([f"--{table}.dataloader.{name}", value])
