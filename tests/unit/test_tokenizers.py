"""The tokenizer interface over its three backends (SentencePiece, Hugging Face tokenizer.json,
tiktoken ranks), each built here from a small corpus: the same contract for all of them, how a
file's kind is told, BOS/EOS, the tokenizer a config names, and the errors."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.launch import REPO
from tests.unit.test_tokenizer import sentences
from trainer.config.job_config import JobConfig
from trainer.data.shards import read_manifest
from trainer.data.tokenizer import (Tokenizer, TokenizerError, check_vocab_fits, configured_tokenizer,
                                    load_tokenizer, tokenize_documents, tokenizer_file, train_hf_tokenizer,
                                    train_tokenizer)
from trainer.data.tokenizer_backends import LLAMA3_SPECIAL_TOKENS

KINDS = ("sentencepiece", "huggingface", "tiktoken")


def corpus_lines(n: int = 1500) -> list[str]:
    return sentences(n) + ["Tabs\tand\nnew lines, 12345 digits; punctuation!?", "Zürich café 日本語 🦙"] * 20


def byte_level_characters() -> dict[str, int]:
    """The printable character a byte-level BPE shows for each byte: printable Latin-1 bytes
    stand for themselves, the others take the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shown, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            shown[chr(byte)] = byte
        else:
            shown[chr(256 + extra)] = byte
            extra += 1
    return shown


def write_tiktoken_ranks(hf_tokenizer_json: Path, out: Path) -> int:
    """A tiktoken ranks file from a trained byte-level BPE: the 256 bytes, then its merged
    tokens in the order they were learned (their ids). Returns the number of ranks."""
    spec = json.loads(hf_tokenizer_json.read_text())
    shown = byte_level_characters()
    ranks = [bytes([b]) for b in range(256)]
    for token, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1]):
        if len(token) > 1:
            ranks.append(bytes(shown[c] for c in token))
    out.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks)))
    return len(ranks)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """{kind: tokenizer file}, plus "base_ranks": the tiktoken file's base ranks."""
    folder = tmp_path_factory.mktemp("tokenizers")
    (folder / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    hf = train_hf_tokenizer([str(folder / "corpus.txt")], str(folder / "hf"), 600)
    (folder / "tiktoken").mkdir()
    base = write_tiktoken_ranks(hf, folder / "tiktoken" / "tokenizer.model")
    sentencepiece = train_tokenizer([str(folder / "corpus.txt")], str(folder / "sp"), 400)
    return {"sentencepiece": str(sentencepiece), "huggingface": str(hf),
            "tiktoken": str(folder / "tiktoken" / "tokenizer.model"), "base_ranks": base}


TEXTS = {
    "ascii": "The river falls slowly. Unseen words: xylophone quokka!",
    "whitespace runs": "a   b    c\t \t d   ",
    "leading and trailing spaces": "   padded   ",
    "newlines": "line one\nline two\n\n\nend\n",
    "carriage returns": "dos\r\nline\r\n",
    "tabs": "col\tcol\t\tcol\t",
    "unicode": "Zürich naïve café — 日本語, Ελληνικά, עברית",
    "emoji": "llamas 🦙🦙 and a family 👩\u200d👩\u200d👧 with flags 🇫🇷",
    "special token spellings": "<|begin_of_text|>hi<|end_of_text|> <s>x</s> <|eot_id|><|reserved_special_token_3|>",
    "empty": "",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TEXTS)
def test_lossless_round_trip(built, kind, name):
    tok = load_tokenizer(built[kind])
    ids = tok.encode(TEXTS[name])
    assert tok.decode(ids) == TEXTS[name]
    assert all(0 <= i < tok.vocab_size for i in ids)


@pytest.mark.parametrize("kind", KINDS)
def test_special_token_text_stays_text(built, kind):
    """A document that spells a special token cannot forge a document boundary."""
    tok = load_tokenizer(built[kind])
    ids = tok.encode(TEXTS["special token spellings"])
    assert tok.bos_id not in ids and tok.eos_id not in ids
    if kind == "tiktoken":
        assert max(ids) < built["base_ranks"]  # no special id at all
    assert len(ids) > 5  # spelled out in pieces, not one id per spelling


@pytest.mark.parametrize("kind, vocab_size, bos_eos", [
    ("sentencepiece", 400, (1, 2)),
    ("huggingface", None, (0, 1)),  # trained with BOS and EOS first; its size is what the corpus held
    ("tiktoken", None, None),  # Llama 3's: BOS and EOS are the first two ids after the ranks
])
def test_vocab_size_and_document_framing(built, kind, vocab_size, bos_eos):
    tok = load_tokenizer(built[kind])
    if kind == "huggingface":
        spec = json.loads(Path(built[kind]).read_text())
        vocab_size = len(spec["model"]["vocab"])  # the specials are part of the trained vocab
        assert 258 < vocab_size <= 600
    if kind == "tiktoken":
        vocab_size = built["base_ranks"] + 256
        bos_eos = (built["base_ranks"], built["base_ranks"] + 1)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (vocab_size, *bos_eos)
    text = "A small garden."
    body = tok.encode(text)
    assert tok.encode_document(text) == [bos_eos[0], *body, bos_eos[1]]
    assert tok.encode(text, bos=True, eos=True) == tok.encode_document(text)
    assert len(body) < len(text)  # merges learned from the corpus
    docs = sentences(5, seed=3) + [TEXTS["emoji"]]
    expected = [tok.encode_document(d) for d in docs]
    assert tok.encode_batch_documents(docs) == expected
    assert tok.encode_batch_documents(docs, num_threads=2) == expected
    assert tokenize_documents(docs, tok).tolist() == [i for ids in expected for i in ids]


@pytest.mark.parametrize("kind", KINDS)
def test_pickled_by_path(built, kind):
    """Tokenizer worker processes receive the tokenizer pickled: its path, not its vocabulary."""
    tok = load_tokenizer(built[kind])
    data = pickle.dumps(tok)
    copy = pickle.loads(data)
    assert len(data) < 500 and type(copy) is type(tok)
    assert (copy.path, copy.sha256, copy.vocab_size, copy.eos_id) == (tok.path, tok.sha256, tok.vocab_size, tok.eos_id)
    assert copy.encode_batch_documents(["hello world", "again"]) == tok.encode_batch_documents(["hello world", "again"])


def test_the_kind_is_read_from_the_content(built, tmp_path):
    """Llama 3 ships tiktoken ranks as tokenizer.model, the name SentencePiece models have too."""
    for kind in KINDS:
        copy = tmp_path / kind / "tokenizer.model"
        copy.parent.mkdir()
        copy.write_bytes(Path(built[kind]).read_bytes())
        assert load_tokenizer(copy).kind == kind
        assert type(Tokenizer(copy)) is type(load_tokenizer(copy))  # the interface loads by content too
    tok = load_tokenizer(built["sentencepiece"])
    assert tok.sha256 == load_tokenizer(tmp_path / "sentencepiece" / "tokenizer.model").sha256


def test_prepared_shards_record_the_tokenizer(built, tmp_path):
    from trainer.data.prepare import prepare

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(50)))
    for kind in KINDS:
        prepare([str(tmp_path / "docs.jsonl")], built[kind], str(tmp_path / kind), validation_fraction=0.0)
        tok = load_tokenizer(built[kind])
        made_with = read_manifest(str(tmp_path / kind), "--output")["tokenizer"]
        assert made_with == {"file": built[kind], "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                             "bos_id": tok.bos_id, "eos_id": tok.eos_id}


# BOS and EOS of a tokenizer.json: the files beside it, else what it shows itself.

def write_hf(folder: Path, built: dict, *, post_processor="keep", added=None, beside: dict | None = None) -> Path:
    """A copy of the trained tokenizer.json with another post-processor or added tokens, and
    files beside it ({name: content})."""
    spec = json.loads(Path(built["huggingface"]).read_text())
    if post_processor != "keep":
        spec["post_processor"] = post_processor
    if added is not None:
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in added]
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    for name, content in (beside or {}).items():
        (folder / name).write_text(json.dumps(content))
    return folder / "tokenizer.json"


def template(before: str | None, after: str | None) -> dict:
    """A post-processor adding the special tokens `before` and `after` the text (None: none)."""
    items = [{"SpecialToken": {"id": before, "type_id": 0}}] if before else []
    items.append({"Sequence": {"id": "A", "type_id": 0}})
    items += [{"SpecialToken": {"id": after, "type_id": 0}}] if after else []
    return {"type": "TemplateProcessing", "single": items, "pair": items, "special_tokens": {}}


def test_bos_and_eos_of_a_hugging_face_tokenizer(built, tmp_path):
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    # Llama 3's tokenizer.json alone: its template adds BOS only; EOS is the added <|end_of_text|>.
    llama3 = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}, template(bos, None)]}
    alone = write_hf(tmp_path / "alone", built, post_processor=llama3)
    assert (load_tokenizer(alone).bos_id, load_tokenizer(alone).eos_id) == (0, 1)
    # The files beside it decide first: tokenizer_config.json (strings, or {"content": ...}) ...
    swapped = write_hf(tmp_path / "config", built, beside={"tokenizer_config.json": {
        "bos_token": {"content": eos, "special": True}, "eos_token": bos}})
    assert (load_tokenizer(swapped).bos_id, load_tokenizer(swapped).eos_id) == (1, 0)
    # ... then special_tokens_map.json; null there means no BOS.
    mapped = write_hf(tmp_path / "map", built,
                      beside={"special_tokens_map.json": {"bos_token": None, "eos_token": eos}})
    assert (load_tokenizer(mapped).bos_id, load_tokenizer(mapped).eos_id) == (None, 1)
    assert load_tokenizer(mapped).encode_document("hi") == [*load_tokenizer(mapped).encode("hi"), 1]
    # A post-processor that frames the text (here within a Sequence): BOS before it, EOS after it.
    framed = write_hf(tmp_path / "framed", built, added=[],
                      post_processor={"type": "Sequence", "processors": [template(eos, bos)]})
    assert (load_tokenizer(framed).bos_id, load_tokenizer(framed).eos_id) == (1, 0)


def test_an_eos_named_nowhere_is_supplied_and_a_null_eos_is_refused(built, tmp_path):
    """(Adding tokens a folder names: tests/unit/test_tokenizer_specials.py.)"""
    size = load_tokenizer(built["huggingface"]).vocab_size
    # Named nowhere: the conventional spellings, here in the trained vocabulary already (ids 0 and 1).
    unnamed = load_tokenizer(write_hf(tmp_path / "unnamed", built, post_processor=None, added=[]))
    assert (unnamed.bos_id, unnamed.eos_id, unnamed.vocab_size, unnamed.added) == (0, 1, size, [])
    assert unnamed.notes == [
        f"{unnamed.path} names no {role} token, nor does a tokenizer_config.json or special_tokens_map.json beside "
        f"it: using its {spelling!r} (id {token_id}) as {short}"
        for role, spelling, token_id, short in (("beginning-of-sequence", "<|begin_of_text|>", 0, "BOS"),
                                                ("end-of-sequence", "<|end_of_text|>", 1, "EOS"))]
    # Named by tokenizer_config.json, missing from tokenizer.json: added after the vocabulary.
    unknown = load_tokenizer(write_hf(tmp_path / "unknown", built,
                                      beside={"tokenizer_config.json": {"eos_token": "<|eot_id|>"}}))
    assert (unknown.bos_id, unknown.eos_id, unknown.vocab_size) == (0, size, size + 1)
    assert unknown.notes == [f"added '<|eot_id|>' (EOS) to {unknown.path} at id {size}: "
                             f"{tmp_path / 'unknown' / 'tokenizer_config.json'} names it"]
    # A config that says there is none: documents could not be separated.
    null = write_hf(tmp_path / "null", built, beside={"tokenizer_config.json": {"eos_token": None}})
    with pytest.raises(TokenizerError, match=re.escape(
            f"{null} defines no end-of-sequence token, which separates documents ({null.parent}/tokenizer_config.json "
            "sets eos_token to null: set it to a token of the tokenizer, or remove the key to have '<|end_of_text|>' "
            "added)")):
        load_tokenizer(null)


def test_errors_name_the_file_and_the_setting(built, tmp_path):
    with pytest.raises(TokenizerError, match=f"model.tokenizer_path: {tmp_path}/missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json", "model.tokenizer_path")
    with pytest.raises(TokenizerError, match=f"--tokenizer: {tmp_path} is a folder; give the tokenizer file in it"):
        load_tokenizer(tmp_path, "--tokenizer")
    (tmp_path / "garbage.model").write_bytes(b"\x00\x01 not a model at all")
    with pytest.raises(TokenizerError, match="garbage.model is not a tokenizer of a known kind: expected a "
                                             "Hugging Face tokenizer.json, a tiktoken BPE ranks file"):
        load_tokenizer(tmp_path / "garbage.model")
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(TokenizerError, match="config.json is not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "config.json")
    (tmp_path / "ranks.model").write_text("IQ== 0\nIg== 1\nnot a rank line\n")
    with pytest.raises(TokenizerError, match="ranks.model line 3 is not 'base64-token rank'"):
        load_tokenizer(tmp_path / "ranks.model")
    (tmp_path / "gaps.model").write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(TokenizerError, match=r"its 2 ranks are not 0..1 once each"):
        load_tokenizer(tmp_path / "gaps.model")


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_must_fit_the_model(built, kind, caplog):
    tok = load_tokenizer(built[kind])
    size = tok.vocab_size
    with caplog.at_level(logging.INFO, logger="trainer.data.tokenizer"):
        check_vocab_fits(tok, size)
        assert not caplog.records  # equal: nothing to say
        check_vocab_fits(tok, 2048)
    assert [r.getMessage() for r in caplog.records] == [
        f"tokenizer {tok.path} has {size} tokens, the model's vocabulary 2048: {2048 - size} embedding rows are "
        "never used"]
    with pytest.raises(TokenizerError, match=f"model.hf_assets_path: {tok.path} has {size} tokens but the model's "
                                             f"vocabulary has 256; use a model.flavor with a vocabulary of at least "
                                             f"{size}, or a tokenizer of at most 256 tokens"):
        check_vocab_fits(tok, 256, "model.hf_assets_path")


# The tokenizer a config names.

def model_section(**values):
    return replace(JobConfig().model, **values)


def test_the_configured_tokenizer_file(built, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    assert tokenizer_file(model_section()) == ("", "")
    assert tokenizer_file(model_section(hf_assets_path=str(hub))) == ("", "")  # needed by no dataset
    with pytest.raises(TokenizerError, match=f"model.hf_assets_path: {hub} holds neither tokenizer.json nor "
                                             "tokenizer.model, and dataset 'files' is text and needs a tokenizer"):
        tokenizer_file(model_section(hf_assets_path=str(hub)), needed_by="files")
    with pytest.raises(TokenizerError, match="model.tokenizer_path: dataset 'c4' is text and needs a tokenizer: set "
                                             "model.tokenizer_path to a Hugging Face tokenizer.json"):
        tokenizer_file(model_section(), needed_by="c4")
    (hub / "tokenizer.model").write_bytes(Path(built["tiktoken"]).read_bytes())
    assert tokenizer_file(model_section(hf_assets_path=str(hub))) == (str(hub / "tokenizer.model"),
                                                                       "model.hf_assets_path")
    (hub / "tokenizer.json").write_bytes(Path(built["huggingface"]).read_bytes())
    assert tokenizer_file(model_section(hf_assets_path=str(hub)))[0] == str(hub / "tokenizer.json")
    both = model_section(hf_assets_path=str(hub), tokenizer_path=built["sentencepiece"])
    assert tokenizer_file(both) == (built["sentencepiece"], "model.tokenizer_path")
    assert configured_tokenizer(both, 2048).kind == "sentencepiece"
    assert configured_tokenizer(model_section(hf_assets_path=str(hub)), 2048).kind == "huggingface"
    with pytest.raises(TokenizerError, match=f"model.hf_assets_path: {hub}/tokenizer.json has \\d+ tokens but"):
        configured_tokenizer(model_section(hf_assets_path=str(hub)), 256)


def test_llama3_special_token_table():
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    positions = {token: i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    assert [positions[t] for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                   "<|eot_id|>", "<|reserved_special_token_0|>", "<|reserved_special_token_5|>",
                                   "<|reserved_special_token_250|>")] == [0, 1, 6, 7, 9, 2, 10, 255]


def test_command_line_trains_a_tokenizer_json_and_encodes_with_every_kind(built, tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(800)))
    command = [sys.executable, "-m", "trainer.data.tokenizer"]
    done = subprocess.run([*command, "train", "--kind", "hf", "--input", str(tmp_path / "c.jsonl"), "--vocab-size",
                           "300", "--output", str(tmp_path / "mine")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {tmp_path / 'mine' / 'tokenizer.json'} (300 tokens; BOS 0, EOS 1)\n"
    assert json.loads((tmp_path / "mine" / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    again = subprocess.run([*command, "train", "--kind", "hf", "--input", str(tmp_path / "c.jsonl"), "--vocab-size",
                            "300", "--output", str(tmp_path / "mine")], capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 2 and "tokenizer.json exists; choose another folder or pass --overwrite" in again.stderr
    for path in (tmp_path / "mine" / "tokenizer.json", built["tiktoken"], built["sentencepiece"]):
        ids = subprocess.run([*command, "encode", "--model", str(path), "--text", "the river 🦙"],
                             capture_output=True, text=True, cwd=REPO)
        assert [int(i) for i in ids.stdout.split()] == load_tokenizer(path).encode("the river 🦙")
    missing = subprocess.run([*command, "encode", "--model", str(tmp_path / "none.json"), "--text", "x"],
                             capture_output=True, text=True, cwd=REPO)
    assert missing.returncode == 2 and missing.stderr == f"error: --model: {tmp_path / 'none.json'} does not exist\n"
    with pytest.raises(TokenizerError, match="--vocab-size: 3 is too small for a byte-level BPE.*at least 4"):
        train_hf_tokenizer([str(tmp_path / "c.jsonl")], str(tmp_path / "small"), 3)


def test_a_byte_level_bpe_smaller_than_the_bytes_keeps_the_most_frequent_and_an_unknown_token(tmp_path):
    """Below 256 bytes + BOS + EOS (the tiny model has 256 ids) the alphabet is the input's most
    frequent bytes; every other byte encodes as <unk>. BOS and EOS stay ids 0 and 1."""
    text = sentences(800)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in text))
    distinct = sorted(set("".join(text).encode()))
    for vocab in (100, 20):
        tokenizer = load_tokenizer(train_hf_tokenizer([str(tmp_path / "c.jsonl")], str(tmp_path / f"v{vocab}"), vocab))
        assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == ("huggingface", vocab, 0,
                                                                                              1)
        assert tokenizer.added == [] and tokenizer._tok.token_to_id("<unk>") == 2
        ids = tokenizer.encode_document(text[0])
        assert ids[0] == 0 and ids[-1] == 1 and max(ids) < vocab
        kept = [b for b in distinct if tokenizer._tok.token_to_id(byte_shown(b)) is not None]
        if vocab == 100:  # room for every byte of the input (some 40), then merges
            assert kept == distinct
            assert all(tokenizer.decode(tokenizer.encode(s)) == s for s in text[:50])
        else:  # 17 bytes, the most frequent ones: space and 'e' first
            assert len(kept) == 17 and {ord(" "), ord("e")} <= set(kept)
        assert tokenizer.decode(tokenizer.encode("a\x01b")) == ("a" if ord("a") in kept else "<unk>") + "<unk>" + (
            "b" if ord("b") in kept else "<unk>")


def byte_shown(byte: int) -> str:
    return next(c for c, b in byte_level_characters().items() if b == byte)
