"""The dataset names torchtitan's configs use, read from local copies: `c4_test` (local files, as
`files`) and `c4_validation` (C4's validation split, streamed from a local copy or the hub), and
the one message a missing copy gets, before any work."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from tests.unit.test_data import ByteTokenizer
from trainer.config.manager import ConfigError, load_config
from trainer.data.build import build_source, check_location, is_streamed
from trainer.data.documents import DataError
from trainer.data.finite_sources import TokenArraySource
from trainer.data.text_sources import StreamingTextSource
from trainer.preflight.checks import check_data

SEQ = 16


def c4_records(split: str, count: int) -> list[dict]:
    """Records shaped as C4's: text, timestamp, url."""
    return [{"text": f"{split} document {i}: " + " ".join(["the river falls"] * (i % 5 + 1)),
             "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{split}/{i}"} for i in range(count)]


@pytest.fixture
def c4_test(tmp_path):
    """A folder laid out as torchtitan's tests/assets/c4_test: data.json, one JSON record per line."""
    folder = tmp_path / "c4_test"
    folder.mkdir()
    (folder / "data.json").write_text("".join(json.dumps(r) + "\n" for r in c4_records("train", 200)))
    return folder


@pytest.fixture
def c4_copy(tmp_path):
    """A local copy of C4's files as the hub names them: en/c4-{train,validation}.0000i-of-00002.json.gz."""
    folder = tmp_path / "c4"
    (folder / "en").mkdir(parents=True)
    for split in ("train", "validation"):
        records = c4_records(split, 40)
        for index in range(2):
            with gzip.open(folder / "en" / f"c4-{split}.{index:05d}-of-00002.json.gz", "wt") as f:
                f.writelines(json.dumps(r) + "\n" for r in records[index * 20:(index + 1) * 20])
    return folder


def source(dataset: str, path: str, split: str, **kwargs):
    return build_source(dataset, path, split=split, vocab_size=259, seed=0, tokenizer=ByteTokenizer(),
                        text_field="text", wrap=True, **kwargs)


def text_of(rows: np.ndarray) -> str:
    return bytes(int(t) - 3 for t in rows.reshape(-1) if t > 2).decode()


def test_c4_test_is_read_as_local_files(c4_test):
    for split in ("train", "validation"):
        named, files = source("c4_test", str(c4_test), split), source("files", str(c4_test), split)
        assert isinstance(named, TokenArraySource) and not is_streamed("c4_test")
        assert np.array_equal(named.rows(0, 8, SEQ + 1), files.rows(0, 8, SEQ + 1))  # one code path
        assert named.fingerprint() == files.fingerprint()
    train, held_out = source("c4_test", str(c4_test), "train"), source("c4_test", str(c4_test), "validation")
    assert text_of(train.rows(0, 4, SEQ + 1)).startswith("train document 0: the river falls")
    # The held-out split: the documents whose text hashes below 5%, never in training.
    def documents(split_source) -> set[str]:  # its tokens cut after each EOS (2)
        tokens = split_source.tokens
        return {text_of(d) for d in np.split(tokens, np.flatnonzero(tokens == 2) + 1) if len(d)}

    assert 0 < len(documents(held_out)) < 200 / 10 and len(documents(held_out) | documents(train)) == 200


def test_c4_validation_is_the_validation_split_of_a_local_copy(c4_copy):
    validation = source("c4_validation", str(c4_copy), "validation", key="validation")
    assert isinstance(validation, StreamingTextSource) and validation.files().count == 2
    rows = validation.batch_rows(0, 4, 0, 4, SEQ + 1)
    assert text_of(rows).startswith("validation document 0: the river falls")
    # Whatever split is asked for (as training.dataset too): C4's validation split.
    as_training = source("c4_validation", str(c4_copy), "train")
    assert np.array_equal(as_training.batch_rows(0, 4, 0, 4, SEQ + 1), rows)
    # The same copy under the name c4 gives either split.
    assert text_of(source("c4", str(c4_copy), "train").batch_rows(0, 4, 0, 4, SEQ + 1)).startswith("train document 0")


def test_a_missing_copy_is_named_with_what_to_put_there(tmp_path, c4_test, monkeypatch):
    with pytest.raises(DataError, match=re.escape(
            "training.dataset_path: required for dataset 'c4_test', a small sample of C4 read from local files: "
            "torchtitan keeps it in its repository as tests/assets/c4_test/data.json, one JSON object per line with "
            'the document in "text": set training.dataset_path to that folder or file (or to any '
            ".jsonl/.json/.parquet/.txt file, folder or glob)")):
        check_location("c4_test", "", "training")
    with pytest.raises(DataError, match=re.escape(f"validation.dataset_path: '{tmp_path}/none' does not exist")):
        check_location("c4_test", str(tmp_path / "none"), "validation")
    with pytest.raises(DataError, match=re.escape(
            f"validation.dataset_path: '{tmp_path}/none' does not exist; for dataset 'c4_validation' it is a local "
            "copy: a folder holding C4's validation files as the hub names them (en/c4-validation.00000-of-00008"
            ".json.gz ... from huggingface.co/datasets/allenai/c4), or files of JSON lines with a \"text\" field "
            "whose names say 'validation' (e.g. validation.jsonl)")):
        check_location("c4_validation", str(tmp_path / "none"), "validation")
    # No copy and the hub turned off: the datasets cache is the last place it could be.
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    check_location("c4_validation", "", "validation")  # online: the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = ("validation.dataset_path: dataset 'c4_validation' is streamed from the Hugging Face hub (allenai/c4, "
               f"config en, split validation), which HF_HUB_OFFLINE=1 turns off, and the Hugging Face datasets cache "
               f"({cache}) does not hold it: set validation.dataset_path to a local copy, a folder holding C4's "
               "validation files")
    with pytest.raises(DataError, match=re.escape(message)):
        check_location("c4_validation", "", "validation")
    with pytest.raises(DataError, match=re.escape(message)):  # the ranks check again (the launcher may go offline)
        source("c4_validation", "", "validation", key="validation")
    (cache / "allenai___c4").mkdir()
    check_location("c4_validation", "", "validation")  # cached: datasets reads it offline
    # A copy without the split the name reads is refused when the source is built, not when first read.
    with pytest.raises(DataError, match=re.escape(
            f"validation.dataset_path: cannot open '{c4_test}' split 'validation' as a local copy of 'c4_validation': "
            "ValueError: Bad split: validation. Available splits: ['train']; it should be a folder holding C4's")):
        source("c4_validation", str(c4_test), "validation", key="validation")


def test_the_check_before_launch_names_the_key(tmp_path, c4_test, c4_copy, monkeypatch):
    (tmp_path / "tok").mkdir()
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.save(str(tokenizer))
    job = ["--model.flavor", "debugmodel", "--model.tokenizer_path", str(tokenizer)]
    with pytest.raises(ConfigError, match=r"^training.dataset_path: required for dataset 'c4_test', a small sample"):
        check_data(load_config([*job, "--training.dataset", "c4_test"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    torchtitan_like = [*job, "--training.dataset", "c4_test", "--training.dataset_path", str(c4_test),
                       "--validation.enable", "--validation.dataset", "c4_validation"]
    with pytest.raises(ConfigError, match=r"^validation.dataset_path: dataset 'c4_validation' is streamed from the "
                                          r"Hugging Face hub \(allenai/c4, config en, split validation\)"):
        check_data(load_config(torchtitan_like))
    check_data(load_config([*torchtitan_like, "--validation.dataset_path", str(c4_copy)]))
