"""The tokenizer interface and its three backends, told apart by the file's content:

- Hugging Face: tokenizer.json (a JSON object). BOS / EOS: as tokenizer_config.json or
  special_tokens_map.json beside it name them, else as tokenizer.json itself shows them. Tokens
  those files name that tokenizer.json lacks are added, and so are conventional BOS / EOS tokens
  when no file names any (trainer.data.tokenizer_specials).
- tiktoken: BPE ranks, one "base64-token rank" per line (Llama 3's original tokenizer.model),
  with Llama 3's special tokens after them. BOS / EOS: <|begin_of_text|> / <|end_of_text|>.
- SentencePiece: a binary SentencePiece model (.model). BOS / EOS: the model's own pieces.

Documents are encoded as [BOS] text [EOS]. Text is always plain text: a special token's spelling
inside a document is encoded like any other characters, never as the special token, so a
document cannot forge a document boundary and decode(encode(text)) == text.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from pathlib import Path

import sentencepiece as spm
import tiktoken
from tokenizers import Tokenizer as HFTokenizer

from trainer.data.tokenizer_specials import (BESIDE, LLAMA3_BOS, LLAMA3_EOS, TokenizerError, add_missing_specials,
                                             brief, named_specials)

# Llama 3's pre-tokenization: contractions, letter runs, numbers of up to 3 digits, punctuation
# runs, newline runs and other whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's 256 special tokens, numbered from the number of base ranks on.
LLAMA3_SPECIAL_TOKENS = [
    LLAMA3_BOS, LLAMA3_EOS, *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]
KINDS = "a Hugging Face tokenizer.json, a tiktoken BPE ranks file (Llama 3's tokenizer.model) or a SentencePiece model"


class Tokenizer:
    """The interface. Tokenizer(path) loads the file with the backend its content calls for;
    backends set vocab_size (every id, special ones included), bos_id (None: no BOS) and eos_id,
    and implement _encode_text, decode and, where they can do better, _encode_texts. `added`
    lists the tokens added to the file on loading ([spelling, id]), `notes` says why, one line
    each (trainer.data.tokenizer.load_tokenizer logs them)."""

    kind = ""

    def __new__(cls, path=None):
        if cls is Tokenizer:
            cls = backend_class(path)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._sha256: str | None = None
        self.vocab_size: int = 0
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.added: list[list] = []
        self.notes: list[str] = []

    def __getstate__(self) -> dict:  # pickled for tokenizer worker processes: they load the file
        return {"path": self.path, "sha256": self._sha256}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
        self._sha256 = state["sha256"]

    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_texts(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return [self._encode_text(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._encode_text(text)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def _wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def encode_document(self, text: str) -> list[int]:
        return self._wrap(self._encode_text(text))

    def encode_batch_documents(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """One thread by default: the data pipeline runs one process per core (prepare's
        workers, the training ranks), where each process's own thread pool gained nothing
        (prepare with 2 workers on 2 cores: 2.76M tokens/s with 1 thread each, 2.84M with a pool
        each) and would compete with its neighbours (benchmarks/data_shards.py)."""
        return [self._wrap(ids) for ids in self._encode_texts(list(texts), num_threads)]

    @property
    def sha256(self) -> str:
        """The tokenizer's identity in manifests and checkpoints: the file's SHA-256, taken over
        the tokens added on loading too when there are any (the same file beside another
        tokenizer_config.json can be another tokenizer)."""
        if self._sha256 is None:
            with open(self.path, "rb") as f:
                digest = hashlib.sha256(f.read())
            if self.added:
                digest.update(json.dumps(self.added).encode())
            self._sha256 = digest.hexdigest()
        return self._sha256

    def _require_eos(self, looked_in: str) -> None:
        if self.eos_id is None:
            raise TokenizerError(f"{self.path} defines no end-of-sequence token, which separates documents "
                                 f"(looked in {looked_in})")


def backend_class(path) -> type[Tokenizer]:
    """The backend for a file, from its first bytes: a JSON object is a Hugging Face
    tokenizer.json, lines of "base64 rank" are tiktoken ranks, anything else is left to
    SentencePiece (a binary protobuf), whose loader refuses what it is not."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise TokenizerError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise TokenizerError(f"{path} is a folder; give the tokenizer file in it "
                             "(tokenizer.json or tokenizer.model)") from None
    if head.lstrip()[:1] == b"{":
        return HuggingFaceTokenizer
    if re.fullmatch(rb"[A-Za-z0-9+/]+=*[ \t]+\d+", head.split(b"\n", 1)[0].strip()):
        return TiktokenTokenizer
    return SentencePieceTokenizer


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError, ValueError) as e:  # ValueError: its message quotes undecodable bytes
            raise TokenizerError(f"{self.path} is not a tokenizer of a known kind: expected {KINDS} "
                                 f"(as a SentencePiece model: {brief(e)})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self._require_eos("the model's pieces")

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def _encode_texts(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return self._sp.Encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds(list(ids))


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        try:
            self._tok = HFTokenizer.from_file(self.path)
            spec = json.loads(Path(self.path).read_text())
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise TokenizerError(f"{self.path} is not a Hugging Face tokenizer.json ({brief(e)})") from None
        self._tok.encode_special_tokens = True  # a special token's spelling in a document stays text
        named = named_specials(self.path, spec)
        try:
            self.added, self.notes = add_missing_specials(self._tok, self.path, named)
        except UnicodeEncodeError as e:  # JSON can spell half a surrogate pair (\ud800), which is no text
            raise TokenizerError(f"{self.path}: the special token {brief(repr(e.object), 80)} (named by it or a "
                                 f"{' or '.join(BESIDE)} beside it) is not valid Unicode: {e.reason}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # the embedding must hold the largest id
        spellings = {role: named.roles.get(role, (None, ""))[0] for role in ("bos", "eos")}
        self.bos_id, self.eos_id = (self._tok.token_to_id(spellings[role]) if spellings[role] else None
                                    for role in ("bos", "eos"))
        if self.eos_id is None:
            raise TokenizerError(f"{self.path} defines no end-of-sequence token, which separates documents "
                                 f"({named.roles['eos'][1]} sets eos_token to null: set it to a token of the "
                                 f"tokenizer, or remove the key to have {LLAMA3_EOS!r} added)")

    def _encode_text(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_texts(self, texts: list[str], num_threads: int) -> list[list[int]]:
        if num_threads == 1:  # the library's batch call uses a pool of all cores
            return super()._encode_texts(texts, num_threads)
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """Byte-level BPE ranks as Llama 3's original tokenizer.model stores them, with Llama 3's
    special tokens numbered after the base ranks and its pre-tokenization pattern."""

    kind = "tiktoken"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        ranks = read_ranks(self.path)
        base = len(ranks)
        self._specials = {token: base + index for index, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(Path(self.path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self._specials)
        self.vocab_size = base + len(LLAMA3_SPECIAL_TOKENS)
        self.bos_id, self.eos_id = self._specials[LLAMA3_BOS], self._specials[LLAMA3_EOS]

    def _encode_text(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # ordinary: special tokens' spellings stay text

    def _encode_texts(self, texts: list[str], num_threads: int) -> list[list[int]]:
        if num_threads == 1:
            return super()._encode_texts(texts, num_threads)
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads if num_threads > 0 else os.cpu_count())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode_bytes(list(ids)).decode("utf-8", errors="replace")


def read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken ranks file: {token bytes: rank}, the ranks 0..n-1 (special tokens follow them)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise TokenizerError(f"{path} line {number} is not 'base64-token rank': "
                                     f"{line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: its {len(ranks)} ranks are not 0..{len(ranks) - 1} once each, so the special "
                             "tokens numbered after them would collide")
    # Byte-level BPE encodes any text from single bytes up; tiktoken aborts on a byte it lacks.
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: lacks {len(missing)} of the 256 single bytes (the first: {missing[0]:#04x}), "
                             "which a byte-level BPE needs to encode any text; it is cut short or not a BPE ranks file")
    return ranks
