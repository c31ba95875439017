"""Training a tokenizer on local text: a SentencePiece model, or a byte-level BPE written as a
Hugging Face tokenizer.json (with Llama 3's pre-tokenization and BOS/EOS spellings)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from trainer.data.tokenizer_backends import LLAMA3_BOS, LLAMA3_EOS, LLAMA3_PATTERN, TokenizerError

BYTES = 256  # a byte-level BPE starts from every byte
UNK = "<unk>"  # below BYTES + 2 pieces, the bytes left out of the alphabet encode as this
SPECIALS = 2  # BOS and EOS


def _training_documents(inputs: list[str], text_field: str):
    """The documents of the input files: files, folders and globs of every format the data
    pipeline reads (trainer.data.documents), compressed or not."""
    from trainer.data.documents import DataError, ReadCounts, find_data_files, read_files

    try:
        files = sorted({f for path in inputs for f in find_data_files(path, key="--input")})
        yield from read_files(files, text_field, ReadCounts())
    except DataError as e:
        raise TokenizerError(str(e).replace("training.dataset_text_field", "--text-field")) from None


def train_tokenizer(inputs: list[str], output_prefix: str, vocab_size: int, *, model_type: str = "bpe",
                    text_field: str = "text", character_coverage: float = 1.0, max_sentences: int = 1_000_000,
                    overwrite: bool = False) -> Path:
    """Train a SentencePiece model (unk 0, BOS 1, EOS 2, byte fallback) and return its .model path."""
    import sentencepiece as spm

    model_path = Path(f"{output_prefix}.model")
    if model_path.exists() and not overwrite:
        raise TokenizerError(f"--output: {model_path} exists; choose another name or pass --overwrite")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as corpus:
        for document in _training_documents(inputs, text_field):
            corpus.writelines(line + "\n" for line in document.splitlines() if line.strip())
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


def train_hf_tokenizer(inputs: list[str], output: str, vocab_size: int, *, text_field: str = "text",
                       overwrite: bool = False) -> Path:
    """Train a byte-level BPE and write the folder `output` as a model hub folder holds a
    tokenizer: tokenizer.json (BOS <|begin_of_text|> and EOS <|end_of_text|> first, ids 0 and 1)
    and a tokenizer_config.json naming them. Returns the tokenizer.json path.

    A vocabulary smaller than the 256 bytes plus BOS and EOS (the tiny model has 256 ids) holds
    the most frequent bytes of the input only, and an <unk> token (id 2) that every other byte
    encodes as: text made of the kept bytes round-trips, a rare byte decodes as '<unk>'."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = Path(output)
    path = folder / "tokenizer.json"
    if path.exists() and not overwrite:
        raise TokenizerError(f"--output: {path} exists; choose another folder or pass --overwrite")
    small = vocab_size < BYTES + SPECIALS
    if vocab_size < SPECIALS + 2:
        raise TokenizerError(f"--vocab-size: {vocab_size} is too small for a byte-level BPE, which holds BOS, EOS, "
                             f"<unk> and at least one byte; give at least {SPECIALS + 2} (from {BYTES + SPECIALS} "
                             "on, every byte has a token of its own)")
    specials = [LLAMA3_BOS, LLAMA3_EOS, *([UNK] if small else [])]
    tokenizer = Tokenizer(models.BPE(unk_token=UNK) if small else models.BPE())
    # Llama 3's split of text into words before merging, then bytes shown as printable characters.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    # Every byte, whether the input holds it or not; or, when they do not all fit, the most
    # frequent ones (an initial alphabet would be kept whole, whatever limit_alphabet says).
    alphabet = (dict(limit_alphabet=vocab_size - len(specials)) if small
                else dict(initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False, **alphabet)
    try:
        tokenizer.train_from_iterator(_training_documents(inputs, text_field), trainer)
    except TokenizerError:
        raise
    except Exception as e:  # the library raises a bare Exception
        raise TokenizerError(f"training on {', '.join(inputs)} failed: {e}") from None
    # The file alone shows how this trainer frames a document: [BOS] text [EOS].
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A {LLAMA3_EOS}", special_tokens=[(LLAMA3_BOS, 0), (LLAMA3_EOS, 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": LLAMA3_BOS, "eos_token": LLAMA3_EOS,
              **({"unk_token": UNK} if small else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path
