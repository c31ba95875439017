"""SentencePiece tokenizer: training, round trips, document encoding, errors, CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.launch import REPO
from trainer.data.tokenizer import Tokenizer, TokenizerError, check_vocab_fits, train_tokenizer

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
    tok = Tokenizer(tokenizer_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (400, 1, 2)
    assert len(tok.encode("the river")) < len("the river")  # merges learned from the corpus


def test_train_from_jsonl_with_a_custom_field(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for s in sentences(1500, seed=1):
            f.write(json.dumps({"body": s}) + "\n")
    path = train_tokenizer([str(tmp_path / "docs.jsonl")], str(tmp_path / "j"), 350, text_field="body")
    assert Tokenizer(path).vocab_size == 350


@pytest.mark.parametrize("text", ["The river falls slowly.", "Unseen words: xylophone quokka", "Zürich 2026 naïve café",
                                  "digits 0123456789 and  double  spaces"])
def test_round_trip(tokenizer_path, text):
    tok = Tokenizer(tokenizer_path)
    assert tok.decode(tok.encode(text)) == text


def test_document_encoding(tokenizer_path):
    tok = Tokenizer(tokenizer_path)
    text = "A small garden."
    assert tok.encode_document(text) == [1, *tok.encode(text), 2]
    assert tok.encode(text, bos=True, eos=True) == tok.encode_document(text)
    docs = sentences(5, seed=3)
    assert tok.encode_batch_documents(docs) == [tok.encode_document(d) for d in docs]


def test_a_pickled_tokenizer_loads_its_file_again(tokenizer_path):
    """Tokenizer worker processes receive the tokenizer pickled."""
    import pickle

    tokenizer = Tokenizer(tokenizer_path)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.path == tokenizer.path and copy.sha256 == tokenizer.sha256
    assert copy.encode_batch_documents(["hello world", "again"]) == tokenizer.encode_batch_documents(["hello world", "again"])


def test_vocab_must_fit_the_model(tokenizer_path):
    tok = Tokenizer(tokenizer_path)
    check_vocab_fits(tok, 400)
    with pytest.raises(TokenizerError, match="has 400 pieces but the model's vocabulary has 256"):
        check_vocab_fits(tok, 256)


def test_errors(tmp_path, tokenizer_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "garbage.model").write_bytes(b"not a model at all")
    with pytest.raises(TokenizerError, match="is not a SentencePiece model"):
        Tokenizer(tmp_path / "garbage.model")
    with pytest.raises(TokenizerError, match="--input: .* does not exist"):
        train_tokenizer([str(tmp_path / "nothing.txt")], str(tmp_path / "t"), 300)


def test_never_overwrites_without_permission(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(sentences(1500)) + "\n")
    path = train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 300)
    before = path.read_bytes()
    with pytest.raises(TokenizerError, match="exists; choose another name or pass --overwrite"):
        train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 320)
    assert path.read_bytes() == before
    train_tokenizer([str(tmp_path / "c.txt")], str(tmp_path / "t"), 320, overwrite=True)
    assert Tokenizer(path).vocab_size == 320


def test_command_line(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(sentences(1500)) + "\n")
    command = [sys.executable, "-m", "trainer.data.tokenizer"]
    done = subprocess.run([*command, "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "300",
                           "--output", str(tmp_path / "cli")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'cli.model'} (300 pieces)" in done.stdout
    ids = subprocess.run([*command, "encode", "--model", str(tmp_path / "cli.model"), "--text", "the river"],
                         capture_output=True, text=True, cwd=REPO)
    assert Tokenizer(tmp_path / "cli.model").encode("the river") == [int(i) for i in ids.stdout.split()]
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
    tokenizer = Tokenizer(path)
    assert tokenizer.vocab_size == 300
    assert tokenizer.decode(tokenizer.encode("The quick model.")) == "The quick model."
    (tmp_path / "corpus" / "README.md").write_text("notes")
    with pytest.raises(TokenizerError, match="README.md is not a supported data file"):
        train_tokenizer([str(tmp_path / "corpus")], str(tmp_path / "tok2"), 300, text_field="body")
    with pytest.raises(TokenizerError, match="--text-field: .*a.jsonl.gz line 1 has no field 'text'"):
        train_tokenizer([str(tmp_path / "corpus" / "a.jsonl.gz")], str(tmp_path / "tok3"), 300)
