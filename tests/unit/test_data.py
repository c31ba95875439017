"""Layout invariance, resumption, epochs and errors of the data pipeline."""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest
import torch

from trainer.config.job_config import Parallelism
from trainer.data.loader import BatchLoader, check_evaluation_fits
from trainer.data.build import build_source
from trainer.data.documents import DataError, ReadCounts, find_data_files, read_files
from trainer.data.finite_sources import DataExhausted, TokenArraySource
from trainer.data.hashing import document_unit
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.parallel.dims import ParallelDims

SEQ = 16


class ByteTokenizer:
    """Stand-in with the Tokenizer interface: bytes + 3, BOS 1, EOS 2."""

    vocab_size, bos_id, eos_id = 259, 1, 2

    def encode_document(self, text: str) -> list[int]:
        return [1, *(b + 3 for b in text.encode()), 2]

    def encode_batch_documents(self, texts):
        return [self.encode_document(t) for t in texts]


def read_documents(files: list[str], text_field: str) -> list[str]:
    return list(read_files(files, text_field, ReadCounts()))


def loaders(make_source, dp: int, local: int, global_batch: int = 8):
    """One loader (with its own source, as in separate processes) per data-parallel rank."""
    return [BatchLoader(make_source(), seq_len=SEQ, global_batch_size=global_batch, local_batch_size=local, dp_rank=r,
                        dp_degree=dp, device=torch.device("cpu")) for r in range(dp)]


def global_batch_rows(ranks: list[BatchLoader]) -> torch.Tensor:
    """All inputs of one global batch, rank by rank, microbatch by microbatch (with the last label)."""
    rows = []
    for loader in ranks:
        for inputs, labels in loader.next_batch():
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            rows.append(torch.cat([inputs, labels[:, -1:]], dim=1))
    return torch.cat(rows)


LAYOUTS = {"dp1 x bs8": (1, 8), "dp2 x bs4": (2, 4), "dp4 x bs2": (4, 2), "dp2 x bs2 x 2 accumulation": (2, 2)}


def synthetic():
    return SyntheticMarkovSource(vocab_size=512, seed=3)


def text_array():
    rng = np.random.default_rng(0)
    return TokenArraySource(rng.integers(0, 259, size=20000).astype(np.int32), name="array")


@pytest.mark.parametrize("make_source", [synthetic, text_array], ids=["synthetic", "token-array"])
def test_same_rows_in_every_layout_for_20_global_batches(make_source):
    reference = None
    for name, (dp, local) in LAYOUTS.items():
        ranks = loaders(make_source, dp, local)
        assert ranks[0].accumulation_steps == 8 // (dp * local)
        batches = torch.stack([global_batch_rows(ranks) for _ in range(20)])
        if reference is None:
            reference = batches
        assert torch.equal(batches, reference), name
    assert len({tuple(row.tolist()) for row in reference.flatten(0, 1)}) == 160  # no row repeated


def test_tensor_pipeline_context_peers_share_the_data_rank():
    dims = ParallelDims.from_config(
        Parallelism(data_parallel_replicate_degree=2, data_parallel_shard_degree=2, tensor_parallel_degree=2,
                    context_parallel_degree=2, pipeline_parallel_degree=2), 32)
    by_dp = {}
    for rank in range(32):
        c = dims.coordinates(rank)
        by_dp.setdefault(dims.dp_rank_of(rank), set()).add((c["dp_replicate"], c["dp_shard"]))
    assert sorted(by_dp) == [0, 1, 2, 3]
    assert all(len(coords) == 1 for coords in by_dp.values())  # tp/cp/pp coordinates do not matter


@pytest.mark.parametrize("make_source", [synthetic, text_array], ids=["synthetic", "token-array"])
@pytest.mark.parametrize("resume_dp, resume_local", [(2, 4), (1, 8), (4, 2)])
def test_resume_at_step_7_gives_the_same_batches(make_source, resume_dp, resume_local):
    ranks = loaders(make_source, 2, 4)
    uninterrupted = [global_batch_rows(ranks) for _ in range(12)]
    first = loaders(make_source, 2, 4)
    for _ in range(7):
        global_batch_rows(first)
    state = first[0].state_dict()
    assert all(r.state_dict() == state for r in first)  # rank-independent: reshards freely
    resumed = loaders(make_source, resume_dp, resume_local)
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(7, 12):
        assert torch.equal(global_batch_rows(resumed), uninterrupted[step]), step


def test_token_array_windows_and_wrap(caplog):
    tokens = np.arange(100, dtype=np.int32)
    source = TokenArraySource(tokens, name="tiny")
    assert source.rows(0, 2, 10).tolist() == [list(range(10)), list(range(10, 20))]
    assert source.rows(10, 1, 10).tolist() == [list(range(10))]  # 10 rows per epoch: row 10 wraps
    ranks = loaders(lambda: TokenArraySource(np.arange(17 * 10, dtype=np.int32), name="tiny"), 1, 4, global_batch=4)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            ranks[0].next_batch()
    assert "epoch 1 begins in the global batch of sequences 8-11" in caplog.text  # 10 rows/epoch


def test_token_array_stop_mode():
    source = TokenArraySource(np.arange(100, dtype=np.int32), name="tiny", wrap=False)
    source.rows(8, 2, 10)
    with pytest.raises(DataExhausted, match="ends after 10 sequences"):
        source.rows(9, 2, 10)


def test_synthetic_source_properties():
    source = SyntheticMarkovSource(vocab_size=2048, seed=0)
    p = source.slot_probs
    assert source.entropy_floor == pytest.approx(-(p * np.log(p)).sum())
    assert source.entropy_floor == pytest.approx(2.1720, abs=1e-4)
    rows = source.rows(0, 4, 200)
    for row in rows:  # every transition is one of the state's successors
        for a, b in zip(row[:-1], row[1:]):
            assert b in source.successors[a]
    assert all(len(set(s)) == 16 for s in source.successors[:100])
    other_seed = SyntheticMarkovSource(vocab_size=2048, seed=1)
    assert not np.array_equal(other_seed.successors, source.successors)
    validation = SyntheticMarkovSource(vocab_size=2048, seed=0, split="validation")
    assert np.array_equal(validation.successors, source.successors)  # same chain...
    assert not np.array_equal(validation.rows(0, 4, 200), rows)  # ...other walks


def test_synthetic_empirical_entropy_matches_floor():
    source = SyntheticMarkovSource(vocab_size=64, seed=0)
    rows = source.rows(0, 64, 2001)
    counts = np.zeros((64, 64))
    np.add.at(counts, (rows[:, :-1].ravel(), rows[:, 1:].ravel()), 1)
    probs = counts / counts.sum(axis=1, keepdims=True)
    conditional = -(counts * np.log(np.where(probs > 0, probs, 1))).sum() / counts.sum()
    assert conditional == pytest.approx(source.entropy_floor, abs=0.02)


def test_synthetic_generation_speed():
    # Timed in this process's CPU seconds: the speed on one core, also where other tests share the
    # machine's cores (tests/machine_share.py) and take some of this one's wall seconds.
    source = SyntheticMarkovSource(vocab_size=128256, seed=0)
    source.rows(0, 8, 2049)
    start = time.process_time()
    rows = 0
    while time.process_time() - start < 1.0:
        source.rows(rows, 8, 2049)
        rows += 8
    tokens_per_s = rows * 2049 / (time.process_time() - start)
    print(f"synthetic source: {tokens_per_s / 1e6:.2f}M tokens/s on one core")
    assert tokens_per_s > 1e6


# ---------------------------------------------------------------------------------------------
# Local files and Hugging Face folders


DOCS = [f"document number {i}: " + " ".join(["lorem ipsum"] * (i % 7 + 1)) for i in range(60)]


def write_corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("\n\n".join(DOCS[:20]) + "\n")
    with open(folder / "b.jsonl", "w") as f:
        for doc in DOCS[20:40]:
            f.write(json.dumps({"body": doc, "id": 1}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[40:], "id": list(range(20))}), folder / "c.parquet")


def test_local_files_of_every_format(tmp_path):
    write_corpus(tmp_path / "corpus")
    files = find_data_files(str(tmp_path / "corpus"))
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.txt", "b.jsonl", "c.parquet"]
    assert read_documents(files, "body") == DOCS
    assert find_data_files(str(tmp_path / "corpus" / "*.jsonl")) == [str(tmp_path / "corpus" / "b.jsonl")]
    source = build_source("files", str(tmp_path / "corpus"), split="train", vocab_size=259, seed=0,
                          tokenizer=ByteTokenizer(), text_field="body", wrap=True, validation_fraction=0.0)
    expected = np.concatenate([ByteTokenizer().encode_document(d) for d in DOCS])
    assert np.array_equal(source.tokens, expected)


def test_holdout_split_of_local_files_is_chosen_by_document_text(tmp_path):
    write_corpus(tmp_path / "corpus")
    kwargs = dict(vocab_size=259, seed=0, tokenizer=ByteTokenizer(), text_field="body", wrap=True,
                  validation_fraction=0.2)
    train = build_source("files", str(tmp_path / "corpus"), split="train", **kwargs)
    held_out = build_source("files", str(tmp_path / "corpus"), split="validation", **kwargs)
    expected_val = [d for d in DOCS if document_unit(d) < 0.2]
    assert 6 <= len(expected_val) <= 18  # 60 documents, 20% expected
    assert np.array_equal(held_out.tokens, np.concatenate([ByteTokenizer().encode_document(d) for d in expected_val]))
    assert np.array_equal(train.tokens, np.concatenate([ByteTokenizer().encode_document(d) for d in DOCS
                                                        if d not in expected_val]))
    # A new file (sorted first) moves no document between the splits.
    (tmp_path / "corpus" / "0-new.txt").write_text("\n\n".join(f"new document {i}" for i in range(30)) + "\n")
    grown = build_source("files", str(tmp_path / "corpus"), split="validation", **kwargs)
    old_tokens = held_out.tokens.tobytes()
    assert old_tokens in grown.tokens.tobytes() and len(grown.tokens) > len(held_out.tokens)


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        find_data_files(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl/.json/.parquet/.txt files found"):
        find_data_files(str(tmp_path / "empty"))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match="notes.md is not a supported data file .* select the data files with a glob"):
        find_data_files(str(tmp_path))
    (tmp_path / "notes.md").unlink()
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read as parquet"):
        read_documents([str(tmp_path / "bad.parquet")], "text")
    (tmp_path / "x.jsonl").write_text('{"content": "hi"}\n')
    with pytest.raises(DataError, match="has no field 'text'; its fields are content"):
        read_documents([str(tmp_path / "x.jsonl")], "text")
    (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n')
    with pytest.raises(DataError, match="holds no train documents"):
        build_source("files", str(tmp_path / "empty.jsonl"), split="train", vocab_size=259, seed=0,
                     tokenizer=ByteTokenizer(), text_field="text", wrap=True)
    with pytest.raises(DataError, match="needs|set model.tokenizer_path"):
        build_source("files", str(tmp_path), split="train", vocab_size=259, seed=0, tokenizer=None,
                     text_field="text", wrap=True)


def test_entropy_floor_is_ln_branching_bound():
    assert SyntheticMarkovSource(vocab_size=300, seed=0).entropy_floor < math.log(16)


def validation_loader(tokens: int) -> BatchLoader:
    source = TokenArraySource(np.arange(tokens, dtype=np.int32) % 50, name="files:v:validation")
    return BatchLoader(source, seq_len=SEQ, global_batch_size=4, local_batch_size=2, dp_rank=0, dp_degree=2,
                       device=torch.device("cpu"), name="validation")


def test_a_validation_split_smaller_than_one_evaluation_is_named(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.data.loader"):
        check_evaluation_fits(validation_loader(10 * (SEQ + 1)), steps=3)  # 10 sequences, 12 read
    assert "one evaluation reads 12 sequences of 16 tokens but the split holds 10" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.data.loader"):
        check_evaluation_fits(validation_loader(12 * (SEQ + 1)), steps=3)
    assert caplog.text == ""
    with pytest.raises(DataError, match="fewer than one sequence of 17"):
        check_evaluation_fits(validation_loader(SEQ), steps=1)


@pytest.mark.parametrize("dp", [2, 4])
def test_a_finite_source_ends_on_every_rank_at_the_same_global_batch(dp):
    """11 sequences, global batch 4: batch 3 is incomplete, yet rank 0's own rows of it exist."""
    source = TokenArraySource(np.arange(11 * (SEQ + 1), dtype=np.int32) % 50, name="files:t", wrap=False)
    loaders = [BatchLoader(source, seq_len=SEQ, global_batch_size=4, local_batch_size=4 // dp, dp_rank=r, dp_degree=dp,
                           device=torch.device("cpu")) for r in range(dp)]
    for loader in loaders:
        loader.next_batch()
        loader.next_batch()
        with pytest.raises(DataExhausted, match="ends after 11 sequences"):
            loader.next_batch()
