"""The synthetic_context source: markers where the position says, copies at the stated distance,
rows that are a pure function of (seed, split, row), and a best loss that the generating process
itself reaches and a previous-token model cannot."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config.manager import ConfigError
from trainer.data.build import build_source
from trainer.data.synthetic_context import SyntheticContextSource


def source(**kwargs) -> SyntheticContextSource:
    return SyntheticContextSource(vocab_size=256, seed=0, row_length=65, **kwargs)


def test_markers_copies_and_chain_steps_where_the_process_puts_them():
    s = source()
    rows = s.rows(0, 512, 65)
    for t in range(1, 65):
        marker = s.marker_at(t)
        if marker is not None:  # every 12th position, cycling through the 4 highest ids
            assert (rows[:, t] == marker).all() and marker == 252 + (t // 12 - 1) % 4
    assert rows[:, 0].max() < s.first_marker_id  # a row starts on a chain state
    free = [t for t in range(4, 65) if s.marker_at(t) is None]
    copied = np.mean(rows[:, free] == rows[:, [t - 4 for t in free]])
    assert 0.5 <= copied < 0.56  # half are copies, a few chain steps land on the same token
    chain = [(a, b) for row in rows[:8] for t, (a, b) in enumerate(zip(row[:-1], row[1:]), start=1)
             if s.marker_at(t) is None and (t < 4 or b != row[t - 4])]
    assert all(b in s.successors[a] for a, b in chain)  # everything else is a step of the chain


def test_rows_depend_on_seed_split_and_index_only():
    s = source()
    assert np.array_equal(s.rows(10, 3, 65), s.rows(0, 16, 65)[10:13])
    assert not np.array_equal(s.rows(0, 4, 65), source(split="validation").rows(0, 4, 65))
    assert not np.array_equal(s.rows(0, 4, 65), SyntheticContextSource(vocab_size=256, seed=1).rows(0, 4, 65))


def test_the_floor_is_the_true_conditional_entropy_and_context_is_worth_a_nat():
    s = source()
    floor, stderr = s.entropy_floor_for(65)
    fresh = -s.true_log_probs(s.rows(0, 2048, 65)).mean()
    assert fresh == pytest.approx(floor, abs=4 * stderr * np.sqrt(2)) and stderr < 5e-3
    # the best model of the previous token alone (bigram counts from 40,000 other rows), markers given
    train, held_out = s.rows(10_000, 40_000, 65), s.rows(0, 2048, 65)
    counts = np.full((256, 256), 0.01)
    np.add.at(counts, (train[:, :-1].ravel(), train[:, 1:].ravel()), 1)
    log_p = np.log((counts / counts.sum(1, keepdims=True))[held_out[:, :-1], held_out[:, 1:]])
    log_p[:, [t - 1 for t in range(1, 65) if s.marker_at(t) is not None]] = 0.0
    assert -log_p.mean() > floor + 1.4  # measured 2.70 against 1.08 nats
    assert s.describe()["entropy_floor_nats"] == floor


def test_the_job_names_it_and_refuses_a_path_for_it(tmp_path):
    built = build_source("synthetic_context", "", split="train", vocab_size=256, seed=3, tokenizer=None,
                         text_field="text", wrap=True, seq_len=64)
    assert isinstance(built, SyntheticContextSource) and built.row_length == 65 and built.seed == 3
    from trainer.config.manager import load_config
    from trainer.preflight.checks import check

    config = load_config(["--model.flavor", "tiny", "--training.dataset", "synthetic_context",
                          "--training.dataset_path", str(tmp_path)])
    with pytest.raises(ConfigError, match="training.dataset_path: .* is 'synthetic_context', which is built in and reads no path"):
        check(config, 1, "cpu")
