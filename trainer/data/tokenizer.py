"""Tokenizers: loading one of the three kinds (trainer.data.tokenizer_backends), the tokenizer a
job configures, document encoding, and a command line to train and try them.

    python -m trainer.data.tokenizer train --input corpus.jsonl --vocab-size 2048 --output my_tok
    python -m trainer.data.tokenizer train --kind hf --input corpus.jsonl --vocab-size 2048 --output my_tok
    python -m trainer.data.tokenizer encode --model my_tok/tokenizer.json --text "hello"

`train` writes a SentencePiece model (PREFIX.model) by default; `--kind hf` writes a byte-level
BPE as a folder holding tokenizer.json and tokenizer_config.json. `encode` takes any kind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

from trainer import messages
from trainer.config.ranges import shown
from trainer.data.shards import token_dtype
from trainer.data.tokenizer_backends import KINDS, Tokenizer, TokenizerError, backend_class
from trainer.data.tokenizer_train import train_hf_tokenizer, train_tokenizer

__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer", "tokenizer_file", "configured_tokenizer",
           "tokenize_documents", "check_vocab_fits", "train_tokenizer", "train_hf_tokenizer"]

logger = logging.getLogger(__name__)

# What model.hf_assets_path is searched for, in this order (the layout of a model hub download).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(path: str | os.PathLike, key: str = "", say_added: bool = True) -> Tokenizer:
    """The tokenizer in `path`, of the kind its content shows; errors start with `key` (the
    setting or option that named the file) when given. say_added: log the special tokens added
    on loading (trainer.data.tokenizer_specials), one line each; False where another load in
    the same job says it (a check before the job, worker processes)."""
    try:
        tokenizer = backend_class(path)(path)
    except TokenizerError as e:
        raise TokenizerError(f"{key}: {e}" if key else str(e)) from None
    if say_added:
        for note in tokenizer.notes:
            logger.info("tokenizer: %s", note)
    return tokenizer


def tokenizer_file(model, needed_by: str = "") -> tuple[str, str]:
    """(file, config key) of the tokenizer a config's model section names: model.tokenizer_path
    when set, else model.hf_assets_path's tokenizer.json, else its tokenizer.model; ("", "") when
    there is none. needed_by (a text dataset's name) makes having none an error."""
    if model.tokenizer_path:
        return model.tokenizer_path, "model.tokenizer_path"
    folder = model.hf_assets_path
    if folder:
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name), "model.hf_assets_path"
        if needed_by:
            raise TokenizerError(f"model.hf_assets_path: {folder} holds neither {' nor '.join(HF_TOKENIZER_FILES)}, "
                                 f"and dataset {shown(needed_by)} is text and needs a tokenizer; put one there or set "
                                 "model.tokenizer_path to a tokenizer file")
    elif needed_by:
        raise TokenizerError(f"model.tokenizer_path: dataset {shown(needed_by)} is text and needs a tokenizer: set "
                             f"model.tokenizer_path to {KINDS}, or model.hf_assets_path to a folder holding "
                             "tokenizer.json or tokenizer.model (make one: "
                             "python -m trainer.data.tokenizer train --help)")
    return "", ""


def configured_tokenizer(model, model_vocab_size: int, needed_by: str = "",
                         say_unused: bool = True) -> Tokenizer | None:
    """The tokenizer of a config's model section (see tokenizer_file), checked against the
    model's vocabulary; None when there is none. say_unused=False: the preflight's check, which
    leaves saying that rows are unused and which tokens were added to the data pipeline (once)."""
    path, key = tokenizer_file(model, needed_by)
    if not path:
        return None
    tokenizer = load_tokenizer(path, key, say_added=say_unused)
    check_vocab_fits(tokenizer, model_vocab_size, key, say_unused)
    if say_unused:  # the data pipeline's call: say which file the job reads, once
        logger.info("tokenizer: %s (%s, %d tokens, from %s)", tokenizer.path, tokenizer.kind, tokenizer.vocab_size, key)
    return tokenizer


def tokenize_documents(documents: list[str], tokenizer, chunk: int = 1024) -> np.ndarray:
    """[BOS] text [EOS] of every document, concatenated, in the smallest dtype the vocabulary fits."""
    dtype = token_dtype(getattr(tokenizer, "vocab_size", 1 << 32))
    pieces = [np.asarray(ids, dtype=dtype)
              for start in range(0, len(documents), chunk)
              for ids in tokenizer.encode_batch_documents(documents[start:start + chunk])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int, key: str = "model.tokenizer_path",
                     say_unused: bool = True) -> None:
    """A tokenizer larger than the model's vocabulary is an error; a smaller one leaves embedding
    rows unused, which is allowed and said once."""
    if tokenizer.vocab_size > model_vocab_size:
        beyond = [f"{spelling!r} ({token_id})" for spelling, token_id in tokenizer.added
                  if token_id >= model_vocab_size]
        raise TokenizerError(
            f"{key}: {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocabulary has "
            f"{model_vocab_size}; use a model.flavor with a vocabulary of at least {tokenizer.vocab_size}, or a "
            f"tokenizer of at most {model_vocab_size} tokens (trained with --vocab-size <= {model_vocab_size})"
            + ("; the ids beyond the model's hold special tokens added on loading, as its folder names them and "
               f"tokenizer.json lacks them: {', '.join(beyond)}" if beyond else ""))
    if say_unused and tokenizer.vocab_size < model_vocab_size:
        logger.info("tokenizer %s has %d tokens, the model's vocabulary %d: %d embedding rows are never used",
                    tokenizer.path, tokenizer.vocab_size, model_vocab_size, model_vocab_size - tokenizer.vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a tokenizer on local text")
    train.add_argument("--input", nargs="+", required=True,
                       help="files, folders or globs: .jsonl/.json/.parquet/.txt, optionally .gz/.bz2/.xz/.zst")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, BOS and EOS included")
    train.add_argument("--kind", choices=["sentencepiece", "hf"], default="sentencepiece",
                       help="sentencepiece (default): PREFIX.model and PREFIX.vocab; hf: a byte-level BPE, written "
                            "as the folder OUTPUT holding tokenizer.json and tokenizer_config.json")
    train.add_argument("--output", required=True, help="output prefix (sentencepiece) or folder (hf)")
    train.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece only")
    train.add_argument("--text-field", default="text", help="field of .jsonl/.json/.parquet records")
    train.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer of that name")
    encode = commands.add_parser("encode", help="print the token ids of a text")
    encode.add_argument("--model", required=True, help="a tokenizer file of any kind")
    encode.add_argument("--text", required=True)
    args = parser.parse_args(argv)
    messages.configure()
    try:
        if args.command == "train":
            path = _train(args)
            tokenizer = load_tokenizer(path)
            print(f"wrote {path} ({tokenizer.vocab_size} tokens; BOS {tokenizer.bos_id}, EOS {tokenizer.eos_id})")
        else:
            print(" ".join(map(str, load_tokenizer(args.model, "--model").encode(args.text))))
    except TokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _train(args) -> Path:
    if args.kind == "hf":
        return train_hf_tokenizer(args.input, args.output, args.vocab_size, text_field=args.text_field,
                                  overwrite=args.overwrite)
    return train_tokenizer(args.input, args.output, args.vocab_size, model_type=args.model_type,
                           text_field=args.text_field, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
