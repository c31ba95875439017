"""Prepared token shards: the prepare command, reading by memory map, shuffling, resume by
sequences consumed and the data fingerprint."""

from __future__ import annotations

import bz2
import gzip
import json
import logging

import numpy as np
import pytest
import torch

from tests.unit.test_tokenizer import sentences
from trainer.data.build import build_source
from trainer.data.documents import DataError
from trainer.data.finite_sources import ShardSource, TokenArraySource
from trainer.data.hashing import document_unit
from trainer.data.loader import BatchLoader
from trainer.data.prepare import main as prepare_main
from trainer.data.prepare import _check_output, prepare
from trainer.data.shuffle import permute
from trainer.data.tokenizer import Tokenizer, train_tokenizer

SEQ = 16
DOCS = sentences(400, seed=5)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "corpus.txt").write_text("\n".join(sentences(1500)) + "\n")
    return str(train_tokenizer([str(folder / "corpus.txt")], str(folder / "tok"), 400))


def write_formats(folder) -> list[str]:
    """The same 400 documents spread over every supported format; returns them in the order the
    files sort (the order of the concatenation)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir(parents=True, exist_ok=True)
    parts = [DOCS[i:i + 80] for i in range(0, 400, 80)]
    with gzip.open(folder / "a.jsonl.gz", "wt") as f:
        for doc in parts[0]:
            f.write(json.dumps({"text": doc}) + "\n")
        f.write(json.dumps({"text": None}) + "\n" + json.dumps({"text": "  "}) + "\n")  # skipped, counted
    (folder / "b.JSON").write_text(json.dumps([{"text": d} for d in parts[1]]))
    with bz2.open(folder / "c.txt.bz2", "wt") as f:
        f.write("\n\n".join(parts[2]) + "\n")
    pq.write_table(pa.table({"text": parts[3]}), folder / "d.parquet")
    payload = "".join(json.dumps({"text": d}) + "\n" for d in parts[4]).encode()
    (folder / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    return DOCS


def expected_tokens(tokenizer_path: str, documents: list[str]) -> np.ndarray:
    tokenizer = Tokenizer(tokenizer_path)
    return np.concatenate([tokenizer.encode_document(d) for d in documents]).astype(np.int64)


def test_prepare_reads_every_format_and_splits_by_document_hash(tmp_path, tokenizer_path, capsys):
    documents = write_formats(tmp_path / "corpus")
    code = prepare_main(["--input", str(tmp_path / "corpus"), "--tokenizer", tokenizer_path,
                         "--output", str(tmp_path / "shards"), "--workers", "2", "--validation-fraction", "0.1"])
    assert code == 0
    assert "400 documents" not in capsys.readouterr().out  # split between train and validation
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["dtype"] == "<u2" and manifest["skipped_records"] == 2
    validation_docs = [d for d in documents if document_unit(d) < 0.1]
    train_docs = [d for d in documents if document_unit(d) >= 0.1]
    assert 20 <= len(validation_docs) <= 60
    assert manifest["totals"]["validation"]["documents"] == len(validation_docs)
    assert manifest["totals"]["train"]["documents"] == len(train_docs)
    train = ShardSource(str(tmp_path / "shards"), "train")
    assert np.array_equal(train.shards.tokens(0, train.token_count), expected_tokens(tokenizer_path, train_docs))
    validation = ShardSource(str(tmp_path / "shards"), "validation")
    assert np.array_equal(validation.shards.tokens(0, validation.token_count),
                          expected_tokens(tokenizer_path, validation_docs))
    first_shard = np.load(tmp_path / "shards" / "train" / f"{manifest['sources'][0]['name']}.docs.npy")
    assert first_shard[0] == 0 and first_shard[-1] == manifest["sources"][0]["splits"]["train"]["tokens"]
    assert len(first_shard) == manifest["sources"][0]["splits"]["train"]["documents"] + 1


def test_prepare_resumes_and_refuses_to_mix_settings(tmp_path, tokenizer_path, caplog):
    write_formats(tmp_path / "corpus")
    args = dict(text_field="text", validation_fraction=0.05, workers=1)
    first = prepare([str(tmp_path / "corpus")], tokenizer_path, str(tmp_path / "shards"), **args)
    # An interrupted run: the manifest and one file's record are gone; a file changed meanwhile.
    (tmp_path / "shards" / "manifest.json").unlink()
    (tmp_path / "shards" / "parts" / f"{first['sources'][1]['name']}.json").unlink()
    (tmp_path / "corpus" / "d.parquet").touch()  # same content: kept
    with gzip.open(tmp_path / "corpus" / "a.jsonl.gz", "at") as f:
        f.write(json.dumps({"text": "One more document."}) + "\n")
    with pytest.raises(DataError, match="no manifest.json: not a prepared shard folder, or its preparation did not"):
        ShardSource(str(tmp_path / "shards"), "train")
    with caplog.at_level(logging.INFO, logger="trainer.data.prepare"):
        again = prepare([str(tmp_path / "corpus")], tokenizer_path, str(tmp_path / "shards"), **args)
    assert "5 parts: 3 prepared earlier, 2 to tokenize" in caplog.text
    assert again["totals"]["train"]["documents"] + again["totals"]["validation"]["documents"] == 401
    assert [s["sha256"] for s in again["sources"]][2:] == [s["sha256"] for s in first["sources"]][2:]
    (tmp_path / "t.txt").write_text("\n".join(sentences(800, seed=9)) + "\n")
    other = train_tokenizer([str(tmp_path / "t.txt")], str(tmp_path / "other"), 300)
    with pytest.raises(DataError, match="holds shards prepared with other settings \\(dtype|tokenizer_sha256"):
        prepare([str(tmp_path / "corpus")], str(other), str(tmp_path / "shards"), **args)
    assert prepare([str(tmp_path / "corpus")], str(other), str(tmp_path / "shards"), overwrite=True,
                   **args)["tokenizer"]["vocab_size"] == 300



def test_settings_a_manifest_holds_beyond_this_versions_are_counted_not_quoted(tmp_path):
    """A manifest's keys come from a file: a key of 100,000 characters (found by fuzzing) made
    the message 100,000 characters long."""
    settings = {"tokenizer_sha256": "ab", "text_field": "text", "validation_fraction": 0.05, "dtype": "<u2"}
    (tmp_path / "manifest.json").write_text(json.dumps({"settings": {**settings, "dtype": "<u4", "x" * 100_000: 1}}))
    with pytest.raises(DataError) as refused:
        _check_output(tmp_path, settings, overwrite=False)
    assert str(refused.value) == (f"--output: {tmp_path} holds shards prepared with other settings (dtype, 1 setting "
                                  "this version does not know); choose another --output, or pass --overwrite to "
                                  "prepare them again")

def test_a_large_jsonl_file_is_cut_into_ranges_that_workers_share(tmp_path, tokenizer_path, monkeypatch, caplog):
    import trainer.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "RANGE_BYTES", 4000)  # 400 documents, ~30 KB: 8 ranges
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare([str(corpus)], tokenizer_path, str(tmp_path / "shards"), workers=2, validation_fraction=0.0)
    ranges = [source["range"] for source in manifest["sources"]]
    assert len(ranges) == -(-corpus.stat().st_size // 4000)
    assert ranges[0][0] == 0 and ranges[-1][1] == corpus.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in file order
    data = corpus.read_bytes()
    assert all(data[start - 1:start] == b"\n" for start, _ in ranges[1:])  # cut at line starts
    train = ShardSource(str(tmp_path / "shards"), "train")
    assert np.array_equal(train.shards.tokens(0, train.token_count), expected_tokens(tokenizer_path, DOCS))
    with open(corpus, "a") as f:  # appended: only the last range changes
        f.write(json.dumps({"text": "One more document."}) + "\n")
    with caplog.at_level(logging.INFO, logger="trainer.data.prepare"):
        again = prepare([str(corpus)], tokenizer_path, str(tmp_path / "shards"), workers=2, validation_fraction=0.0)
    assert f"{len(ranges)} parts: {len(ranges) - 1} prepared earlier, 1 to tokenize" in caplog.text
    assert again["totals"]["train"]["documents"] == 401
    corpus.write_text(corpus.read_text().replace('{"text": "One more', '{"text": One more'))
    with pytest.raises(DataError, match=f"{corpus} byte {len(data)}: not JSON"):
        prepare([str(corpus)], tokenizer_path, str(tmp_path / "shards"), workers=1, validation_fraction=0.0)


def test_a_damaged_shard_folder_is_named(tmp_path, tokenizer_path):
    write_formats(tmp_path / "corpus")
    manifest = prepare([str(tmp_path / "corpus")], tokenizer_path, str(tmp_path / "shards"), workers=1)
    shard = tmp_path / "shards" / "train" / f"{manifest['sources'][2]['name']}.tokens"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=f"shard {shard} should hold .* bytes .* the folder is damaged"):
        ShardSource(str(tmp_path / "shards"), "train")
    with pytest.raises(DataError, match="is not a folder of prepared shards"):
        ShardSource(str(tmp_path / "nowhere"), "train")


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permutation_is_a_bijection_with_a_new_order_every_epoch(n):
    orders = [permute(np.arange(n), n, seed=7, epoch=e) for e in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(orders[0], orders[1])
        assert not np.array_equal(orders[0], permute(np.arange(n), n, seed=8, epoch=0))
        # Any slice gives the same places as the whole (each row on its own).
        assert np.array_equal(permute(np.arange(5, 12), n, 7, 2), orders[2][5:12])


def loaders(make_source, dp: int, local: int, global_batch: int):
    return [BatchLoader(make_source(), seq_len=SEQ, global_batch_size=global_batch, local_batch_size=local,
                        dp_rank=r, dp_degree=dp, device=torch.device("cpu")) for r in range(dp)]


def batch_rows(ranks: list[BatchLoader]) -> np.ndarray:
    rows = []
    for loader in ranks:
        for inputs, labels in loader.next_batch():
            rows.append(torch.cat([inputs, labels[:, -1:]], dim=1).numpy())
    return np.concatenate(rows)


@pytest.fixture
def shard_folder(tmp_path, tokenizer_path):
    write_formats(tmp_path / "corpus")
    prepare([str(tmp_path / "corpus")], tokenizer_path, str(tmp_path / "shards"), workers=1)
    return str(tmp_path / "shards")


def test_shuffled_shards_read_every_sequence_once_per_epoch_in_every_layout(shard_folder):
    def source():
        return ShardSource(shard_folder, "train", shuffle_seed=3)

    per_epoch = source().rows_per_epoch(SEQ + 1)
    assert per_epoch > 100
    single = loaders(source, 1, 8, 8)
    reference = [batch_rows(single) for _ in range(2 * per_epoch // 8)]
    for dp, local in ((2, 4), (4, 1)):
        ranks = loaders(source, dp, local, 8)
        for step, expected in enumerate(reference[:20]):
            assert np.array_equal(batch_rows(ranks), expected), (dp, local, step)
    plain = ShardSource(shard_folder, "train")
    all_sequences = plain.rows(0, per_epoch, SEQ + 1)
    first_epoch = np.concatenate(reference)[:per_epoch]
    assert sorted(map(bytes, first_epoch.astype(np.int16))) == sorted(map(bytes, all_sequences.astype(np.int16)))
    assert not np.array_equal(first_epoch[:8], all_sequences[:8])  # not file order
    second = np.concatenate(reference)[per_epoch:2 * per_epoch]
    assert not np.array_equal(second[:8], first_epoch[:8])  # a new order in epoch 2


def make_sources(kind: str, shard_folder: str, stream_folder):
    from trainer.data.text_sources import StreamingTextSource, hub_stream_opener

    if kind == "shards":
        return lambda: ShardSource(shard_folder, "train", shuffle_seed=1)
    if kind == "files":
        tokens = ShardSource(shard_folder, "train").shards.tokens(0, 6000)
        return lambda: TokenArraySource(tokens, name="files:corpus:train", shuffle_seed=1)
    tokenizer = Tokenizer(json.loads((stream_folder.parent / "shards" / "manifest.json").read_text())["tokenizer"]["file"])
    return lambda: StreamingTextSource(hub_stream_opener("c4", str(stream_folder), "train"), tokenizer,
                                       text_field="text", name="c4:train")


@pytest.mark.parametrize("kind", ["files", "shards", "stream"])
@pytest.mark.parametrize("new_global_batch,new_dp", [(16, 4), (4, 2)])
def test_resume_with_another_global_batch_continues_after_the_last_sequence(kind, new_global_batch, new_dp,
                                                                             shard_folder, tmp_path, caplog):
    (tmp_path / "c4" / "data").mkdir(parents=True)
    (tmp_path / "c4" / "data" / "train-00000-of-00001.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    make = make_sources(kind, shard_folder, tmp_path / "c4")
    reference = loaders(make, 1, 8, 8)
    uninterrupted = np.concatenate([batch_rows(reference) for _ in range(11)])
    first = loaders(make, 2, 4, 8)
    for _ in range(5):
        batch_rows(first)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["rows_consumed"] == 40 and state["global_batch_size"] == 8
    resumed = loaders(make, new_dp, new_global_batch // new_dp, new_global_batch)
    with caplog.at_level(logging.INFO, logger="trainer.data.loader"):
        for loader in resumed:
            loader.load_state_dict(state)
    assert f"global batch was 8 sequences, this run's is {new_global_batch}: continuing after sequence 40" in caplog.text
    rows = np.concatenate([batch_rows(resumed) for _ in range(48 // new_global_batch)])
    assert np.array_equal(rows, uninterrupted[40:88])


def test_resume_on_other_data_names_the_change_unless_accepted(shard_folder, caplog):
    saved = loaders(lambda: ShardSource(shard_folder, "train", shuffle_seed=1), 1, 8, 8)[0]
    saved.next_batch()
    state = saved.state_dict()
    reseeded = loaders(lambda: ShardSource(shard_folder, "train", shuffle_seed=2), 1, 8, 8)[0]
    with pytest.raises(DataError, match="training data differs from the checkpoint's: shuffle_seed 1 -> 2 "
                                        "\\(training.data_seed, or debug.seed when unset\\). .*"
                                        "checkpoint.accept_data_change = true"):
        reseeded.load_state_dict(state)
    longer = BatchLoader(ShardSource(shard_folder, "train", shuffle_seed=1), seq_len=SEQ * 2, global_batch_size=8,
                         local_batch_size=8, dp_rank=0, dp_degree=1, device=torch.device("cpu"),
                         accept_data_change=True)
    with caplog.at_level(logging.WARNING, logger="trainer.data.loader"):
        longer.load_state_dict(state)
    assert "seq_len 16 -> 32" in caplog.text and longer.rows_consumed == 8


def test_a_checkpoint_of_the_step_counting_loader_still_loads(shard_folder, caplog):
    loader = loaders(lambda: ShardSource(shard_folder, "train"), 1, 8, 8)[0]
    loader.expect_saved_keys({"step", "epoch"})
    assert set(loader.state_dict()) == {"step", "epoch"}  # the template DCP fills
    with caplog.at_level(logging.WARNING, logger="trainer.data.loader"):
        loader.load_state_dict({"step": 3, "epoch": 0})
    assert loader.rows_consumed == 24 and "predates data fingerprints" in caplog.text
    assert "rows_consumed" in loader.state_dict()


def test_shards_through_build_source(shard_folder):
    source = build_source("shards", shard_folder, split="validation", vocab_size=512, seed=0, tokenizer=None,
                          text_field="text", wrap=True)
    assert source.describe()["shards"] == 5 and source.shuffle_seed is None
    with pytest.raises(DataError, match="training.dataset_path: required for dataset 'shards'"):
        build_source("shards", "", split="train", vocab_size=512, seed=0, tokenizer=None, text_field="text", wrap=True)


@pytest.mark.parametrize("dp,local", [(1, 4), (2, 4), (3, 2), (4, 8)])
def test_a_validation_batch_is_the_same_rows_in_every_layout(dp, local):
    """10 sequences over any DP degree: each rank's rows in order, the rest padded with ignored labels."""
    from trainer.loss import IGNORE_INDEX

    tokens = np.arange(40 * (SEQ + 1), dtype=np.int32) % 97
    ranks = [BatchLoader(TokenArraySource(tokens, name="v"), seq_len=SEQ, global_batch_size=10, local_batch_size=local,
                         dp_rank=r, dp_degree=dp, device=torch.device("cpu"), name="validation", pad_uneven=True)
             for r in range(dp)]
    for batch in range(2):
        counted = []
        micro_counts = set()
        for loader in ranks:
            microbatches = loader.next_batch()
            micro_counts.add(len(microbatches))
            for inputs, labels in microbatches:
                keep = (labels != IGNORE_INDEX).all(dim=1)
                assert ((labels == IGNORE_INDEX).all(dim=1) | keep).all()  # a row counts wholly or not at all
                counted.append(torch.cat([inputs[keep], labels[keep][:, -1:]], dim=1))
        assert len(micro_counts) == 1  # every rank runs the same number of forward passes
        expected = TokenArraySource(tokens, name="v").rows(10 * batch, 10, SEQ + 1)
        assert np.array_equal(torch.cat(counted).numpy(), expected)


def test_mixture_blocks_give_each_source_its_share_in_every_stretch_of_rows():
    from trainer.data.mixture import block_counts, block_schedule

    counts = block_counts([0.7, 0.2, 0.1], block=100)
    assert counts.tolist() == [70, 20, 10]
    assert block_counts([1, 1, 1], block=100).sum() == 100
    schedule = block_schedule(counts)
    assert np.bincount(schedule).tolist() == [70, 20, 10]
    for start in range(0, 92):  # any 8 consecutive rows: each source's share to within one row
        window = np.bincount(schedule[start:start + 8], minlength=3)
        assert (np.abs(window - 8 * np.array([0.7, 0.2, 0.1])) < 1 + 1e-9).all(), (start, window)


def test_a_mixture_reads_each_source_as_alone_in_every_layout():
    from trainer.data.mixture import MixtureSource

    web = np.arange(50_000, dtype=np.int32) % 200
    code = 1000 + np.arange(3_000, dtype=np.int32) % 50  # small: repeats within the run

    def make():
        return MixtureSource([TokenArraySource(web, name="web", shuffle_seed=4),
                              TokenArraySource(code, name="code", shuffle_seed=4)],
                             ["web", "code"], [3.0, 1.0], block=40)

    single = loaders(make, 1, 8, 8)
    rows = np.concatenate([batch_rows(single) for _ in range(30)])  # 240 rows = 6 blocks
    from_code = rows[:, 0] >= 1000
    assert from_code.sum() == 60  # a quarter, exactly, block by block
    alone_web = TokenArraySource(web, name="web", shuffle_seed=4).rows(0, 180, SEQ + 1)
    alone_code = TokenArraySource(code, name="code", shuffle_seed=4).rows(0, 60, SEQ + 1)
    assert np.array_equal(rows[~from_code], alone_web) and np.array_equal(rows[from_code], alone_code)
    assert make().rows_drawn(240).tolist() == [180, 60]
    for dp, local in ((2, 4), (4, 2)):
        ranks = loaders(make, dp, local, 8)
        assert np.array_equal(np.concatenate([batch_rows(ranks) for _ in range(30)]), rows)
    fingerprint = make().fingerprint()
    assert fingerprint["weights"] == [3.0, 1.0] and len(fingerprint["parts"]) == 2


def test_document_masking_drops_the_targets_after_each_eos():
    from trainer.loss import IGNORE_INDEX

    tokens = np.array([1, 5, 6, 2, 1, 7, 2, 1, 8, 9, 10, 2, 1, 4, 4, 4, 4, 2] * 4, dtype=np.int32)
    plain, masked = (BatchLoader(TokenArraySource(tokens, name="t", eos_id=2), seq_len=8, global_batch_size=2,
                                 local_batch_size=2, dp_rank=0, dp_degree=1, device=torch.device("cpu"),
                                 document_eos=eos) for eos in (None, 2))
    (inputs, labels), = plain.next_batch()
    (masked_inputs, masked_labels), = masked.next_batch()
    assert torch.equal(inputs, masked_inputs)
    after_eos = inputs == 2
    assert after_eos.sum() == 3  # rows 1 5 6 [2] 1 7 [2] 1 | 9 10 [2] 1 4 4 4 4
    assert (masked_labels[after_eos] == IGNORE_INDEX).all() and torch.equal(labels[after_eos], torch.ones(3).long())
    assert torch.equal(masked_labels[~after_eos], labels[~after_eos])


def test_prepare_streams_a_hugging_face_dataset_in_parts(tmp_path, tokenizer_path, caplog):
    """A dataset folder laid out like the hub's, split among 2 workers by its 3 data files."""
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for index in range(3):
        records = [{"text": d} for d in DOCS[index * 100:(index + 1) * 100]] + [{"text": None}]
        (tmp_path / "hub" / "data" / f"train-0000{index}-of-00003.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    args = dict(workers=2, dataset="c4", dataset_path=str(tmp_path / "hub"), validation_fraction=0.1)
    manifest = prepare([], tokenizer_path, str(tmp_path / "shards"), **args)
    assert [s["name"] for s in manifest["sources"]] == ["c4-train-00000-of-00002", "c4-train-00001-of-00002"]
    assert manifest["skipped_records"] == 3
    train = ShardSource(str(tmp_path / "shards"), "train")
    expected = expected_tokens(tokenizer_path, [d for d in DOCS[:300] if document_unit(d) >= 0.1])
    assert np.array_equal(train.shards.tokens(0, train.token_count), expected)
    with caplog.at_level(logging.INFO, logger="trainer.data.prepare"):
        again = prepare([], tokenizer_path, str(tmp_path / "shards"), **args)
    assert "2 parts: 2 prepared earlier, 0 to tokenize" in caplog.text and again["digest"] == manifest["digest"]
    with pytest.raises(DataError, match="give either --input .* or --dataset"):
        prepare([str(tmp_path)], tokenizer_path, str(tmp_path / "other"), dataset="c4")


def test_files_count_the_records_without_text(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["One.", None, " ", "Two.", 3]))

    class Bytes:
        vocab_size, bos_id, eos_id = 259, 1, 2

        def encode_batch_documents(self, texts):
            return [[1, *(b + 3 for b in t.encode()), 2] for t in texts]

    with caplog.at_level(logging.WARNING, logger="trainer.data.build"):
        source = build_source("files", str(tmp_path / "a.jsonl"), split="train", vocab_size=259, seed=0,
                              tokenizer=Bytes(), text_field="text", wrap=True, validation_fraction=0.0)
    assert source.describe()["skipped_records"] == 3 and source.token_count == 2 * 2 + 4 + 4
    assert "a.jsonl: 3" in caplog.text
