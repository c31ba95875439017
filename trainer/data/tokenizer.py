"""SentencePiece tokenizer: loading, document encoding, and training on local text.

    python -m trainer.data.tokenizer train --input corpus.txt --vocab-size 2048 --output my_tok
    python -m trainer.data.tokenizer encode --model my_tok.model --text "hello"
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm

from trainer.data.shards import token_dtype


class TokenizerError(ValueError):
    """A problem with a tokenizer file or its training input; the message names the file."""


class Tokenizer:
    """A SentencePiece model. Documents are encoded as [BOS] text [EOS] and joined by the data
    pipeline, so the model must define EOS."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._sha256: str | None = None
        if not os.path.isfile(self.path):
            raise TokenizerError(f"model.tokenizer_path: {self.path!r} does not exist")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"model.tokenizer_path: {self.path!r} is not a SentencePiece model ({e})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        if self.eos_id is None:
            raise TokenizerError(f"model.tokenizer_path: {self.path!r} defines no end-of-sequence piece, "
                                 "which separates documents")

    def __getstate__(self) -> dict:  # pickled for tokenizer worker processes: they load the file
        return {"path": self.path, "sha256": self._sha256}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
        self._sha256 = state["sha256"]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._sp.EncodeAsIds(text)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds(list(ids))

    def _wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def encode_document(self, text: str) -> list[int]:
        return self._wrap(self._sp.EncodeAsIds(text))

    def encode_batch_documents(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """One thread by default: the data pipeline runs one process per core (prepare's
        workers, the training ranks), where each process's own thread pool gained nothing
        (prepare with 2 workers on 2 cores: 2.76M tokens/s with 1 thread each, 2.84M with a pool
        each) and would compete with its neighbours (benchmarks/data_shards.py)."""
        return [self._wrap(ids) for ids in self._sp.Encode(list(texts), num_threads=num_threads)]

    @property
    def sha256(self) -> str:
        """The model file's SHA-256: the tokenizer's identity in manifests and checkpoints."""
        if self._sha256 is None:
            with open(self.path, "rb") as f:
                self._sha256 = hashlib.sha256(f.read()).hexdigest()
        return self._sha256


def tokenize_documents(documents: list[str], tokenizer, chunk: int = 1024) -> np.ndarray:
    """[BOS] text [EOS] of every document, concatenated, in the smallest dtype the vocabulary fits."""
    dtype = token_dtype(getattr(tokenizer, "vocab_size", 1 << 32))
    pieces = [np.asarray(ids, dtype=dtype)
              for start in range(0, len(documents), chunk)
              for ids in tokenizer.encode_batch_documents(documents[start:start + chunk])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"model.tokenizer_path: {tokenizer.path} has {tokenizer.vocab_size} pieces but the model's vocabulary has "
            f"{model_vocab_size}; use a model.flavor with a larger vocabulary or a tokenizer trained with "
            f"--vocab-size <= {model_vocab_size}"
        )


def _training_lines(inputs: list[str], text_field: str):
    """The text of the input files, line by line: files, folders and globs of every format the
    data pipeline reads (trainer.data.documents), compressed or not."""
    from trainer.data.documents import DataError, ReadCounts, find_data_files, read_files

    try:
        files = sorted({f for path in inputs for f in find_data_files(path, key="--input")})
        for document in read_files(files, text_field, ReadCounts()):
            yield from (line for line in document.splitlines() if line.strip())
    except DataError as e:
        raise TokenizerError(str(e).replace("training.dataset_text_field", "--text-field")) from None


def train_tokenizer(inputs: list[str], output_prefix: str, vocab_size: int, *, model_type: str = "bpe",
                    text_field: str = "text", character_coverage: float = 1.0, max_sentences: int = 1_000_000,
                    overwrite: bool = False) -> Path:
    """Train a SentencePiece model (unk 0, BOS 1, EOS 2, byte fallback) and return its .model path."""
    model_path = Path(f"{output_prefix}.model")
    if model_path.exists() and not overwrite:
        raise TokenizerError(f"--output: {model_path} exists; choose another name or pass --overwrite")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as corpus:
        for line in _training_lines(inputs, text_field):
            corpus.write(line + "\n")
    try:
        spm.SentencePieceTrainer.Train(
            input=corpus.name, model_prefix=output_prefix, vocab_size=vocab_size, model_type=model_type,
            character_coverage=character_coverage, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
            input_sentence_size=max_sentences, shuffle_input_sentence=True, num_threads=2, minloglevel=2,
            # Lossless: keep text exactly as written (no Unicode normalization, no whitespace folding).
            normalization_rule_name="identity", remove_extra_whitespaces=False,
        )
    except RuntimeError as e:
        raise TokenizerError(f"training on {', '.join(inputs)} failed: {e}") from None
    finally:
        os.unlink(corpus.name)
    return model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a SentencePiece model on local text")
    train.add_argument("--input", nargs="+", required=True,
                       help="files, folders or globs: .jsonl/.json/.parquet/.txt, optionally .gz/.bz2/.xz/.zst")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--output", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    train.add_argument("--text-field", default="text", help="field of .jsonl/.json/.parquet records")
    train.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    encode = commands.add_parser("encode", help="print the token ids of a text")
    encode.add_argument("--model", required=True)
    encode.add_argument("--text", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            path = train_tokenizer(args.input, args.output, args.vocab_size, model_type=args.model_type,
                                   text_field=args.text_field, overwrite=args.overwrite)
            print(f"wrote {path} ({Tokenizer(path).vocab_size} pieces)")
        else:
            print(" ".join(map(str, Tokenizer(args.model).encode(args.text))))
    except TokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
