"""Special tokens a Hugging Face tokenizer folder names but its tokenizer.json lacks, as in
torchtitan's test tokenizer: a byte-level BPE with no added tokens, beside a tokenizer_config.json
whose added_tokens_decoder names <|begin_of_text|> (128000), <|end_of_text|> (128001) and four
tokens of the vocabulary. Such folders are built here; the ids are those Hugging Face
transformers gives."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.test_tokenizer import sentences
from tests.unit.test_tokenizers import TEXTS
from trainer.config.job_config import JobConfig
from trainer.data.tokenizer import TokenizerError, check_vocab_fits, configured_tokenizer, load_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
IN_VOCAB = ("<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|pad|>")  # ordinary tokens of the vocabulary


def entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}


@pytest.fixture(scope="module")
def bare() -> tuple[dict, int]:
    return bare_bpe()


def bare_bpe() -> tuple[dict, int]:
    """(tokenizer.json content, n): a byte-level BPE trained with no special tokens, then n..n+3 =
    IN_VOCAB appended to its vocabulary as ordinary tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences(600) + [TEXTS["unicode"], TEXTS["emoji"]], trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    assert sorted(vocab.values()) == list(range(n)) and spec["added_tokens"] == []
    vocab.update({token: n + i for i, token in enumerate(IN_VOCAB)})
    return spec, n


def torchtitan_like_config(n: int) -> dict:
    return {"added_tokens_decoder": {"128000": entry(BOS), "128001": entry(EOS),
                                     **{str(n + i): entry(token) for i, token in enumerate(IN_VOCAB)}},
            "bos_token": BOS, "eos_token": EOS, "pad_token": "<|pad|>", "clean_up_tokenization_spaces": True,
            "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}


def folder(path: Path, spec: dict, beside: dict | None = None) -> Path:
    """A tokenizer folder: tokenizer.json and the files beside it ({name: content}); returns tokenizer.json."""
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    for name, content in (beside or {}).items():
        (path / name).write_text(json.dumps(content))
    return path / "tokenizer.json"


def loaded(path: Path, caplog) -> tuple:
    """(tokenizer, the lines loading it logged)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.data.tokenizer"):
        tok = load_tokenizer(path)
    return tok, [r.getMessage() for r in caplog.records]


def test_tokens_the_config_names_and_tokenizer_json_lacks_are_added_after_the_vocabulary(bare, tmp_path, caplog):
    spec, n = bare
    path = folder(tmp_path / "tok", spec, {"tokenizer_config.json": torchtitan_like_config(n)})
    tok, logged = loaded(path, caplog)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 6, n + 4, n + 5)
    assert tok.added == [[BOS, n + 4], [EOS, n + 5]]
    config = tmp_path / "tok" / "tokenizer_config.json"
    assert logged == [
        f"tokenizer: added '{BOS}' (BOS) to {path} at id {n + 4}: {config} names it at id 128000; added tokens take "
        "the next free id after the vocabulary",
        f"tokenizer: added '{EOS}' (EOS) to {path} at id {n + 5}: {config} names it at id 128001; added tokens take "
        "the next free id after the vocabulary"]
    assert [tok.decode([n + i]) for i in range(4)] == list(IN_VOCAB)  # the vocabulary's own ids stay
    assert tok.decode([n + 4, n + 5]) == BOS + EOS
    body = tok.encode("A small garden.")
    assert tok.encode_document("A small garden.") == [n + 4, *body, n + 5]
    assert len(body) < len("A small garden.")  # merges learned
    for text in TEXTS.values():
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < n + 4 for i in ids)  # never a special id from text
    assert tok.encode_batch_documents(["one", "two"]) == [tok.encode_document("one"), tok.encode_document("two")]


def test_the_ids_are_those_transformers_gives(bare, tmp_path):
    from transformers import AutoTokenizer

    spec, n = bare
    path = folder(tmp_path / "tok", spec, {"tokenizer_config.json": torchtitan_like_config(n)})
    theirs = AutoTokenizer.from_pretrained(str(path.parent))
    ours = load_tokenizer(path)
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (ours.bos_id, ours.eos_id, ours.vocab_size)
    assert theirs.convert_tokens_to_ids(list(IN_VOCAB)) == [n, n + 1, n + 2, n + 3]
    text = TEXTS["ascii"] + " " + TEXTS["unicode"]
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def test_tokenizer_json_alone_gets_conventional_bos_and_eos(bare, tmp_path, caplog):
    spec, n = bare
    alone, logged = loaded(folder(tmp_path / "alone", spec), caplog)
    assert (alone.vocab_size, alone.bos_id, alone.eos_id, alone.added) == (n + 6, n + 4, n + 5,
                                                                            [[BOS, n + 4], [EOS, n + 5]])
    assert logged == [
        f"tokenizer: added '{BOS}' (BOS) to {alone.path} at id {n + 4}: no beginning-of-sequence token is named by it "
        "or by a tokenizer_config.json or special_tokens_map.json beside it",
        f"tokenizer: added '{EOS}' (EOS) to {alone.path} at id {n + 5}: no end-of-sequence token is named by it or "
        "by a tokenizer_config.json or special_tokens_map.json beside it"]
    assert alone.encode_document("hi") == [n + 4, *alone.encode("hi"), n + 5]
    # Its identity covers the tokens added: the same tokens at the same ids whichever file named them,
    # and not the bare file's.
    configured = load_tokenizer(folder(tmp_path / "tok", spec, {"tokenizer_config.json": torchtitan_like_config(n)}))
    assert alone.sha256 == configured.sha256 != hashlib.sha256(Path(alone.path).read_bytes()).hexdigest()
    # A BOS named without an EOS: the EOS of the same convention.
    paired, logged = loaded(folder(tmp_path / "paired", spec, {"special_tokens_map.json": {"bos_token": "<s>"}}),
                            caplog)
    assert (paired.bos_id, paired.eos_id, paired.added) == (n + 4, n + 5, [["<s>", n + 4], ["</s>", n + 5]])
    assert logged == [
        f"tokenizer: added '<s>' (BOS) to {paired.path} at id {n + 4}: {tmp_path}/paired/special_tokens_map.json "
        "names it",
        f"tokenizer: added '</s>' (EOS) to {paired.path} at id {n + 5}: no end-of-sequence token is named by it or "
        "by a tokenizer_config.json or special_tokens_map.json beside it"]
    # A config that says there is no BOS: none is added (documents are text [EOS]).
    no_bos = load_tokenizer(folder(tmp_path / "no_bos", spec, {"tokenizer_config.json": {"bos_token": None}}))
    assert (no_bos.bos_id, no_bos.eos_id, no_bos.added) == (None, n + 4, [[EOS, n + 4]])
    assert no_bos.encode_document("hi") == [*no_bos.encode("hi"), n + 4]


def test_an_id_the_config_gives_is_kept_when_it_is_the_next_free_one(bare, tmp_path, caplog):
    spec, n = bare
    config = {"added_tokens_decoder": {str(n + 5): entry(EOS), str(n + 4): entry(BOS)}, "bos_token": BOS,
              "eos_token": {"content": EOS}}
    tok, logged = loaded(folder(tmp_path / "next", spec, {"tokenizer_config.json": config}), caplog)
    where = tmp_path / "next" / "tokenizer_config.json"
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n + 4, n + 5, n + 6)
    assert logged == [f"tokenizer: added '{BOS}' (BOS) to {tok.path} at id {n + 4}: {where} names it",
                      f"tokenizer: added '{EOS}' (EOS) to {tok.path} at id {n + 5}: {where} names it"]
    # An id another token holds: the next free one, saying whose the id was.
    taken = {"added_tokens_decoder": {"3": entry("<|eot_id|>")}, "eos_token": "<|eot_id|>"}
    tok, logged = loaded(folder(tmp_path / "taken", spec, {"tokenizer_config.json": taken}), caplog)
    held = load_tokenizer(folder(tmp_path / "plain", spec)).decode([3])
    assert (tok.bos_id, tok.eos_id) == (None, n + 4)  # an EOS without a BOS: documents are text [EOS]
    assert logged == [f"tokenizer: added '<|eot_id|>' (EOS) to {tok.path} at id {n + 4}: "
                      f"{tmp_path}/taken/tokenizer_config.json names it at id 3, which is {held!r} in tokenizer.json"]


def test_a_config_that_contradicts_tokenizer_json_is_refused(bare, tmp_path):
    spec, n = bare
    moved = folder(tmp_path / "moved", spec, {"tokenizer_config.json": {
        "added_tokens_decoder": {"7": entry("<|image|>")}, "eos_token": EOS}})
    with pytest.raises(TokenizerError, match=re.escape(
            f"{moved.parent}/tokenizer_config.json gives '<|image|>' id 7, but {moved} has it at id {n}: the two files "
            "are not of one tokenizer; use the tokenizer_config.json that came with this tokenizer.json, or remove "
            "the entry")):
        load_tokenizer(moved)
    bad_id = folder(tmp_path / "bad_id", spec, {"tokenizer_config.json": {"added_tokens_decoder": {"x1": entry(EOS)}}})
    with pytest.raises(TokenizerError, match=re.escape(
            "tokenizer_config.json: added_tokens_decoder entry 'x1' is not an integer id mapped to "
            '{"content": "<token>", ...}')):
        load_tokenizer(bad_id)
    bad_token = folder(tmp_path / "bad_token", spec, {"tokenizer_config.json": {"eos_token": 5}})
    with pytest.raises(TokenizerError, match=re.escape(
            'tokenizer_config.json: eos_token is 5; give a string, null or {"content": "<token>"}')):
        load_tokenizer(bad_token)


def test_added_ids_beyond_the_model_vocabulary_are_refused(bare, tmp_path, caplog):
    spec, n = bare
    path = folder(tmp_path / "tok", spec, {"tokenizer_config.json": torchtitan_like_config(n)})
    tok = load_tokenizer(path)
    with pytest.raises(TokenizerError, match=re.escape(
            f"model.hf_assets_path: {path} has {n + 6} tokens but the model's vocabulary has {n + 5}; use a "
            f"model.flavor with a vocabulary of at least {n + 6}, or a tokenizer of at most {n + 5} tokens (trained with "
            f"--vocab-size <= {n + 5}); the ids beyond the model's hold special tokens added on loading, as its folder "
            f"names them and tokenizer.json lacks them: '{EOS}' ({n + 5})")):
        check_vocab_fits(tok, n + 5, "model.hf_assets_path")
    model = replace(JobConfig().model, hf_assets_path=str(path.parent))
    with pytest.raises(TokenizerError, match=re.escape(f"'{BOS}' ({n + 4}), '{EOS}' ({n + 5})")):
        configured_tokenizer(model, n + 4, say_unused=False)
    # Said once per job: the check before the job and worker processes stay quiet.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.data.tokenizer"):
        checked = configured_tokenizer(model, n + 6, say_unused=False)
        copy = pickle.loads(pickle.dumps(checked))
    assert caplog.records == []
    assert (copy.vocab_size, copy.bos_id, copy.eos_id, copy.sha256) == (n + 6, n + 4, n + 5, tok.sha256)
    with caplog.at_level(logging.INFO, logger="trainer.data.tokenizer"):
        configured_tokenizer(model, n + 6)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and said[0].startswith(f"tokenizer: added '{BOS}' (BOS) to {path} at id {n + 4}: ")
    assert said[1].startswith(f"tokenizer: added '{EOS}' (EOS) to {path} at id {n + 5}: ")
    assert said[2] == f"tokenizer: {path} (huggingface, {n + 6} tokens, from model.hf_assets_path)"
