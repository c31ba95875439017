"""Fuzzing the tokenizer files the trainer reads (trainer.data.tokenizer_backends): a Hugging Face
tokenizer.json with the tokenizer_config.json and special_tokens_map.json beside it, a tiktoken
ranks file and a SentencePiece model. Hundreds of hostile variants of genuine files (tests/fuzz.py):
each loads into a tokenizer that encodes a document within its vocabulary, or is refused with
one TokenizerError naming the file; no other exception, no crash of the library underneath."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from sentencepiece import sentencepiece_model_pb2 as sp_model

from tests.fuzz import check, dump, files_opened, mutate_bytes, mutate_tree
from tests.unit.test_tokenizer import sentences
from tests.unit.test_tokenizers import write_tiktoken_ranks
from trainer.data.tokenizer import TokenizerError, load_tokenizer, train_hf_tokenizer, train_tokenizer

CASES = 150  # per kind and kind of mutation
FILES = {"huggingface": "tokenizer.json", "tiktoken": "tokenizer.model", "sentencepiece": "sp.model"}
# A document of every kind of text a corpus holds, a special token's spelling included.
DOCUMENT = "Hello wörld, 12345!\n\t日本語 🦙 <|end_of_text|> <s></s> \x00\x7f"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> dict[str, bytes]:
    """The bytes of a genuine file of each kind, and of the tokenizer_config.json beside the
    tokenizer.json (small vocabularies: loading takes a millisecond)."""
    folder = tmp_path_factory.mktemp("genuine")
    (folder / "corpus.txt").write_text("\n".join(sentences(1500) + [DOCUMENT] * 5) + "\n")
    hf = train_hf_tokenizer([str(folder / "corpus.txt")], str(folder / "hf"), 300)
    write_tiktoken_ranks(hf, folder / "tokenizer.model")
    sp = train_tokenizer([str(folder / "corpus.txt")], str(folder / "sp"), 400)
    return {"huggingface": hf.read_bytes(), "tiktoken": (folder / "tokenizer.model").read_bytes(),
            "sentencepiece": Path(sp).read_bytes(),
            "tokenizer_config.json": (hf.parent / "tokenizer_config.json").read_bytes()}


def usable(tokenizer) -> None:
    """What the data pipeline does with a loaded tokenizer: encode documents, ids in range."""
    assert tokenizer.vocab_size >= 1 and tokenizer.eos_id is not None
    ids = tokenizer.encode_document(DOCUMENT)
    assert all(0 <= i < tokenizer.vocab_size for i in ids), "an id beyond the vocabulary"
    tokenizer.decode(ids)


def load_each(folder: Path, written: str, variants, tokenizer: str = "") -> dict[str, int]:
    """Write each (case, bytes) as folder/written, load the tokenizer folder/tokenizer (the
    written file itself by default) and check the contract, and that nothing outside the folder
    was opened (a tokenizer names no other file). Returns how many loaded and were refused."""
    path = folder / (tokenizer or written)
    outcomes = {"loaded": 0, "refused": 0}
    for case, data in variants:
        (folder / written).write_bytes(data)
        with files_opened() as opened:
            outcomes[check(case, lambda: load_tokenizer(path, say_added=False), TokenizerError,
                           [folder / written, path], valid=usable)] += 1
        elsewhere = [p for p in opened if not Path(p).resolve().is_relative_to(folder.resolve())]
        assert not elsewhere, f"{case}: opened {elsewhere}"
    return outcomes


@pytest.mark.parametrize("kind", FILES)
def test_byte_mutations_of_each_kind_load_or_are_refused(tmp_path, genuine, kind):
    rng = random.Random(0)
    variants = [mutate_bytes(genuine[kind], rng) for _ in range(CASES)]
    if kind == "huggingface":  # as trainer.data.tokenizer train writes it
        (tmp_path / "tokenizer_config.json").write_bytes(genuine["tokenizer_config.json"])
    outcomes = load_each(tmp_path, FILES[kind], variants)
    assert outcomes["refused"] > CASES // 4, outcomes


def test_structural_mutations_of_tokenizer_json_load_or_are_refused(tmp_path, genuine):
    rng = random.Random(1)
    tree = json.loads(genuine["huggingface"])
    variants = [(case, dump(mutated)) for case, mutated in (mutate_tree(tree, rng) for _ in range(CASES))]
    outcomes = load_each(tmp_path, "tokenizer.json", variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes


@pytest.mark.parametrize("beside", ["tokenizer_config.json", "special_tokens_map.json"])
def test_mutations_of_the_files_beside_tokenizer_json_load_or_are_refused(tmp_path, genuine, beside):
    """They name the special tokens, which are added when tokenizer.json lacks them."""
    rng = random.Random(2)
    (tmp_path / "tokenizer.json").write_bytes(genuine["huggingface"])
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>", "special": True},
              "added_tokens_decoder": {"0": {"content": "<|begin_of_text|>", "special": True},
                                       "1": {"content": "<|end_of_text|>", "special": True},
                                       "300": {"content": "<|eot_id|>", "special": True}}}
    variants = [(case, dump(mutated)) for case, mutated in (mutate_tree(config, rng) for _ in range(CASES))]
    variants += [mutate_bytes(json.dumps(config).encode(), rng) for _ in range(CASES // 2)]
    outcomes = load_each(tmp_path, beside, variants, tokenizer="tokenizer.json")
    assert outcomes["loaded"] and outcomes["refused"], outcomes


def tiktoken_variant(lines: list[tuple[str, str]], rng: random.Random) -> tuple[str, bytes]:
    """A ranks file whose lines are well formed but whose tokens or ranks are not what they should be."""
    lines = list(lines)
    i = rng.randrange(len(lines))
    kind = rng.choice(["rank", "token", "duplicate", "drop", "swap", "extra field"])
    if kind == "rank":
        lines[i] = (lines[i][0], str(rng.choice([-1, 0, len(lines), 2**63, "9" * 5000, "1e5", "٣", "0x10", "nan"])))
    elif kind == "token":
        token = rng.choice([b"", b"\x00", "<|end_of_text|>".encode(), rng.randbytes(10_000), b"\xff" * 3])
        lines[i] = (base64.b64encode(token).decode() or "=", lines[i][1])
    elif kind == "duplicate":
        lines.insert(rng.randrange(len(lines)), lines[i])
    elif kind == "drop":
        del lines[i]
    elif kind == "swap":
        j = rng.randrange(len(lines))
        lines[i], lines[j] = (lines[i][0], lines[j][1]), (lines[j][0], lines[i][1])
    else:
        lines[i] = (lines[i][0], lines[i][1] + " " + rng.choice(["1", "x", "\u2028"]))
    return f"{kind} at line {i + 1}", "".join(f"{t} {r}\n" for t, r in lines).encode("utf-8", "surrogatepass")


def test_tiktoken_ranks_with_wrong_tokens_or_ranks_load_or_are_refused(tmp_path, genuine):
    rng = random.Random(3)
    lines = [tuple(line.split()) for line in genuine["tiktoken"].decode().splitlines()]
    variants = [tiktoken_variant(lines, rng) for _ in range(CASES)]
    outcomes = load_each(tmp_path, "tokenizer.model", variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes


def sentencepiece_variant(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """A SentencePiece model that parses as one, with a piece or a setting changed."""
    model = sp_model.ModelProto()
    model.ParseFromString(data)
    pieces, spec = model.pieces, model.trainer_spec
    i = rng.randrange(len(pieces))
    kind = rng.choice(["piece", "score", "type", "drop", "duplicate", "no pieces", "special id", "model type",
                       "charsmap", "byte fallback"])
    if kind == "piece":
        pieces[i].piece = rng.choice(["", " ", "\x00", "x" * 100_000, pieces[0].piece, "<|end_of_text|>"])
    elif kind == "score":
        pieces[i].score = rng.choice([float("nan"), float("inf"), -float("inf"), -3e38, 3e38])
    elif kind == "type":
        pieces[i].type = rng.choice([1, 2, 3, 4, 5, 6])
    elif kind == "drop":
        del pieces[i]
    elif kind == "duplicate":
        pieces.add().CopyFrom(pieces[i])
    elif kind == "no pieces":
        del pieces[:]
    elif kind == "special id":
        name = rng.choice(["bos_id", "eos_id", "unk_id", "pad_id"])
        setattr(spec, name, rng.choice([-1, 0, 1, 2, len(pieces), len(pieces) + 5, 2**31 - 1]))
        kind = f"{name} = {getattr(spec, name)}"
    elif kind == "model type":
        spec.model_type = rng.choice([1, 2, 3, 4])
    elif kind == "charsmap":
        model.normalizer_spec.precompiled_charsmap = rng.randbytes(rng.randint(0, 64))
    else:
        spec.byte_fallback = not spec.byte_fallback
    return f"{kind} (piece {i})", model.SerializeToString()


def test_sentencepiece_models_with_wrong_pieces_or_settings_load_or_are_refused(tmp_path, genuine):
    rng = random.Random(4)
    variants = [sentencepiece_variant(genuine["sentencepiece"], rng) for _ in range(CASES)]
    outcomes = load_each(tmp_path, "sp.model", variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes

