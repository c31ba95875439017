"""Training tokenizers on local text (SentencePiece, and a byte-level BPE tokenizer.json) and the
command line; the contract every kind of tokenizer keeps is tested in test_tokenizers.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.launch import REPO
from trainer.data.tokenizer import TokenizerError, load_tokenizer, train_hf_tokenizer, train_tokenizer

WORDS = ("the a model learns tokens from text data every step loss falls quickly slowly when rate is high low "
         "small large river mountain city garden music paper light window seven twelve").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "corpus.txt").write_text("\n".join(sentences(1500)) + "\n")
    return train_tokenizer([str(folder / "corpus.txt")], str(folder / "tok"), 400)


def test_trained_model_has_requested_vocab_and_specials(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (400, 1, 2)
    assert len(tok.encode("the river")) < len("the river")  # merges learned from the corpus


def test_train_from_jsonl_with_a_custom_field(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for s in sentences(1500, seed=1):
            f.write(json.dumps({"body": s}) + "\n")
    path = train_tokenizer([str(tmp_path / "docs.jsonl")], str(tmp_path / "j"), 350, text_field="body")
    assert load_tokenizer(path).vocab_size == 350


def test_training_input_must_exist(tmp_path):
    with pytest.raises(TokenizerError, match="--input: .* does not exist"):
        train_tokenizer([str(tmp_path / "nothing.txt")], str(tmp_path / "t"), 300)
    with pytest.raises(TokenizerError, match="--input: .* does not exist"):
        train_hf_tokenizer([str(tmp_path / "nothing.txt")], str(tmp_path / "t"), 300)


def test_never_overwrites_without_permission(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(sentences(1500)) + "\n")
    path = train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 300)
    before = path.read_bytes()
    with pytest.raises(TokenizerError, match="exists; choose another name or pass --overwrite"):
        train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 320)
    assert path.read_bytes() == before
    train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 320, overwrite=True)
    assert load_tokenizer(path).vocab_size == 320


def test_command_line(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(sentences(1500)) + "\n")
    command = [sys.executable, "-m", "trainer.data.tokenizer"]
    done = subprocess.run([*command, "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "300",
                           "--output", str(tmp_path / "cli")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'cli.model'} (300 tokens; BOS 1, EOS 2)" in done.stdout
    ids = subprocess.run([*command, "encode", "--model", str(tmp_path / "cli.model"), "--text", "the river"],
                         capture_output=True, text=True, cwd=REPO)
    assert load_tokenizer(tmp_path / "cli.model").encode("the river") == [int(i) for i in ids.stdout.split()]
    failed = subprocess.run([*command, "train", "--input", str(tmp_path / "none.txt"), "--vocab-size", "300",
                             "--output", str(tmp_path / "x")], capture_output=True, text=True, cwd=REPO)
    assert failed.returncode == 2 and failed.stderr.startswith("error: --input")
    assert "Traceback" not in failed.stderr


def test_training_reads_folders_and_compressed_files_and_refuses_others(tmp_path):
    import gzip
    import json

    (tmp_path / "corpus").mkdir()
    with gzip.open(tmp_path / "corpus" / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": s}) + "\n" for s in sentences(800))
    (tmp_path / "corpus" / "b.txt").write_text("\n\n".join(sentences(400, seed=1)))
    path = train_tokenizer([str(tmp_path / "corpus")], str(tmp_path / "tok"), 300, text_field="body")
    tokenizer = load_tokenizer(path)
    assert tokenizer.vocab_size == 300
    assert tokenizer.decode(tokenizer.encode("The quick model.")) == "The quick model."
    hf = load_tokenizer(train_hf_tokenizer([str(tmp_path / "corpus")], str(tmp_path / "hf"), 300, text_field="body"))
    assert hf.vocab_size == 300 and hf.decode(hf.encode("The quick model.")) == "The quick model."
    (tmp_path / "corpus" / "README.md").write_text("notes")
    with pytest.raises(TokenizerError, match="README.md is not a supported data file"):
        train_tokenizer([str(tmp_path / "corpus")], str(tmp_path / "tok2"), 300, text_field="body")
    with pytest.raises(TokenizerError, match="--text-field: .*a.jsonl.gz line 1 has no field 'text'"):
        train_tokenizer([str(tmp_path / "corpus" / "a.jsonl.gz")], str(tmp_path / "tok3"), 300)
    with pytest.raises(TokenizerError, match="--text-field: .*a.jsonl.gz line 1 has no field 'text'"):
        train_hf_tokenizer([str(tmp_path / "corpus" / "a.jsonl.gz")], str(tmp_path / "hf3"), 300)
