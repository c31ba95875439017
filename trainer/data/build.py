"""The token sources of a job: which class reads `training.dataset`, and its validation split.

Every source maps a global row index to a fixed sequence of token ids: row i depends only on the
data, the data seed and the row length, so every parallel layout and every resumed run reads
exactly the same tokens (ARCHITECTURE invariant 1). A source has
`rows(first_row, count, length) -> int64 array (count, length)`, `describe()` (for the run
record), `fingerprint()` (what identifies its rows, kept in checkpoints), `entropy_floor` (best
achievable loss, or None) and `random_access` (False: rows must be read in order, and the source
carries a state_dict). Random-access sources also have `check_available(last_row, length)`, which
raises DataExhausted past the end of a finite source that does not wrap.

| dataset        | class                                   | validation split                          |
| synthetic      | synthetic.SyntheticMarkovSource         | other walks of the same chain             |
| synthetic_context | synthetic_context.SyntheticContextSource | other rows of the same process        |
| files, c4_test | finite_sources.TokenArraySource         | documents whose text hashes below the held-out fraction |
| shards         | finite_sources.ShardSource              | the folder's validation shards (same rule, applied when prepared) |
| python_stdlib  | finite_sources.ShardSource (python_corpus's cache) | documents hashing below the held-out fraction |
| hub name or id | text_sources.StreamingTextSource        | the dataset's 'validation' split (one lane, in order) |

`c4_test` is the name torchtitan's configs give its 2,000-document sample of C4, a JSON-lines
file in its repository (tests/assets/c4_test/data.json): small local data, so it is read as
`files` are, from dataset_path (which it requires), with their held-out split. `c4_validation` is
C4's validation split, streamed like any hub dataset (text_sources.HUB_ALIASES), from the hub or
a local copy at dataset_path.

`python_stdlib` is built in real text: the installed Python's standard library, prepared once
into shards in a cache folder (trainer.data.python_corpus) by the launcher, or by the first rank
to get its lock when the trainer runs without it.

[[training.datasets]] mixes files and shards sources by weight (mixture.MixtureSource); its
validation split is the same mixture of the sources' validation splits.
"""

from __future__ import annotations

import logging
import os

from trainer.data.documents import DataError, ReadCounts, find_data_files, read_files
from trainer.data.finite_sources import ShardSource, TokenArraySource
from trainer.data.hashing import document_unit
from trainer.data.mixture import MixtureSource
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.data.synthetic_context import SyntheticContextSource

logger = logging.getLogger(__name__)

DEFAULT_VALIDATION_FRACTION = 0.05
PYTHON_STDLIB = "python_stdlib"  # built in, real text: the installed Python's standard library
LOCAL_FILES = ("files", "c4_test")  # names read by files_source, from dataset_path
FINITE = ("shards", *LOCAL_FILES, PYTHON_STDLIB)
SYNTHETIC = ("synthetic", "synthetic_context")  # built in: no files, endless
BUILT_IN = (*SYNTHETIC, PYTHON_STDLIB)  # nothing to download, no dataset_path
C4_TEST = ("a small sample of C4 read from local files: torchtitan keeps it in its repository as "
           "tests/assets/c4_test/data.json, one JSON object per line with the document in \"text\"")


def is_streamed(dataset: str) -> bool:
    """A Hugging Face dataset by name or id, read as a stream."""
    return dataset not in (*BUILT_IN, "shards", *LOCAL_FILES)


def check_location(dataset: str, dataset_path: str, section: str) -> None:
    """Before any work, without reading data: the data of `dataset` can be found (a local copy at
    dataset_path, or for a streamed dataset the hub or its cache). section: 'training' or
    'validation', whose dataset_path messages name."""
    from trainer.data.text_sources import check_stream_location

    key = f"{section}.dataset_path"
    if dataset == "c4_test":
        if not dataset_path:
            raise DataError(f"{key}: required for dataset 'c4_test', {C4_TEST}: set {key} to that folder or file (or "
                            "to any .jsonl/.json/.parquet/.txt file, folder or glob)")
        find_data_files(dataset_path, key)
    elif is_streamed(dataset):
        check_stream_location(dataset, dataset_path, section)


def data_seed(config) -> int:
    return config.debug.seed if config.training.data_seed is None else config.training.data_seed


def files_source(path: str, split: str, *, tokenizer, text_field: str, wrap: bool, shuffle_seed: int | None,
                 validation_fraction: float, key: str) -> TokenArraySource:
    """Local files tokenized into memory; a document belongs to the validation split when the
    hash of its text is below validation_fraction."""
    from trainer.data.tokenizer import tokenize_documents

    counts = ReadCounts()
    want_validation = split == "validation"
    documents = [text for text in read_files(find_data_files(path, key), text_field, counts)
                 if (document_unit(text) < validation_fraction) == want_validation]
    if not documents:
        raise DataError(f"{key}: {path!r} holds no {split} documents"
                        + (f" (validation takes {validation_fraction:.3g} of the documents by a hash of their text: "
                           "add documents or raise training.validation_fraction)" if want_validation else ""))
    if counts.skipped:
        logger.warning("%s: records without text (null, not a string, or blank) skipped: %s", key,
                       counts.describe_skipped())
    return TokenArraySource(tokenize_documents(documents, tokenizer), name=f"files:{path}:{split}", wrap=wrap,
                            shuffle_seed=shuffle_seed, eos_id=tokenizer.eos_id,
                            skipped_records=sum(counts.skipped.values()))


def python_stdlib_source(split: str, *, vocab_size: int, tokenizer, wrap: bool, shuffle_seed: int | None,
                         validation_fraction: float) -> ShardSource:
    """A split of the built-in corpus, prepared first when no process has yet. Named and
    fingerprinted by the corpus (Python version, digest), not by where its cache folder is."""
    from trainer.data.python_corpus import ensure_prepared

    prepared = ensure_prepared(vocab_size, tokenizer=tokenizer, validation_fraction=validation_fraction)
    if split == "train":
        corpus = prepared.identity
        logger.info("data: %s, %s (%d documents, %.1f MB, SHA-256 %s...), %d pieces, from %s", PYTHON_STDLIB,
                    corpus["python"], corpus["documents"], corpus["bytes"] / 1e6, corpus["sha256"][:12],
                    prepared.manifest["tokenizer"]["vocab_size"], prepared.folder)
    return ShardSource(str(prepared.shards), split, wrap=wrap, shuffle_seed=shuffle_seed, key="training.dataset",
                       name=f"{PYTHON_STDLIB}:{split}",
                       identity={"python": prepared.identity["python"], "corpus_sha256": prepared.identity["sha256"]})


def build_source(dataset: str, dataset_path: str, *, split: str, vocab_size: int, seed: int, tokenizer,
                 text_field: str, wrap: bool, shuffle: bool = False, validation_fraction: float | None = None,
                 key: str = "training", stream: dict | None = None, seq_len: int | None = None):
    """The token source of one split of `dataset` (key: the config section, for messages; stream:
    lanes, workers and prefetch of a streamed dataset, by default one lane read inline; seq_len:
    the length synthetic_context states its best loss for)."""
    from trainer.data import text_sources as text

    shuffle_seed = seed if shuffle else None
    if dataset == "synthetic":
        return SyntheticMarkovSource(vocab_size=vocab_size, seed=seed, split=split)
    if dataset == "synthetic_context":
        length = {"row_length": seq_len + 1} if seq_len else {}
        return SyntheticContextSource(vocab_size=vocab_size, seed=seed, split=split, **length)
    if dataset == "shards":
        if not dataset_path:
            raise DataError(f"{key}.dataset_path: required for dataset 'shards' (a folder written by "
                            "python -m trainer.data.prepare)")
        return ShardSource(dataset_path, split, wrap=wrap, shuffle_seed=shuffle_seed, key=f"{key}.dataset_path")
    fraction = DEFAULT_VALIDATION_FRACTION if validation_fraction is None else validation_fraction
    if dataset == PYTHON_STDLIB:  # tokenizer: the job's own, else one trained on the corpus
        return python_stdlib_source(split, vocab_size=vocab_size, tokenizer=tokenizer, wrap=wrap,
                                    shuffle_seed=shuffle_seed, validation_fraction=fraction)
    if tokenizer is None:
        raise DataError(f"{key}.dataset {dataset!r} is text: set model.tokenizer_path to a tokenizer file, or "
                        "model.hf_assets_path to a folder holding one (make one with "
                        "`python -m trainer.data.tokenizer train`)")
    if dataset in LOCAL_FILES:
        check_location(dataset, dataset_path, key)  # c4_test: says what it is and where it comes from
        if not dataset_path:
            raise DataError(f"{key}.dataset_path: required for dataset 'files' (a file, folder or glob)")
        return files_source(dataset_path, split, tokenizer=tokenizer, text_field=text_field, wrap=wrap,
                            shuffle_seed=shuffle_seed, validation_fraction=fraction, key=f"{key}.dataset_path")
    check_location(dataset, dataset_path, key)  # again here: the launcher turns the hub off after its own checks
    opener = text.hub_stream_opener(dataset, dataset_path, split, section=key)
    source = text.StreamingTextSource(opener, tokenizer, text_field=text_field, name=f"{dataset}:{split}", wrap=wrap,
                                      shuffle_seed=shuffle_seed, **(stream or {}))
    if dataset_path:
        source.files()  # a local copy opens in moments: one without the split it needs is refused now, not when read
    return source


def document_eos(config, source) -> int | None:
    """The EOS id that ends documents when training.document_masking is on, else None."""
    if not config.training.document_masking:
        return None
    if source.eos_id is None:
        raise DataError(f"training.document_masking: {source.describe()['source']} has no documents with a known EOS "
                        "token (the synthetic source, or a mixture of sources prepared with different tokenizers)")
    return int(source.eos_id)


def mixture_names(entries) -> list[str]:
    return [entry.name or os.path.basename(os.path.normpath(entry.path)) for entry in entries]


def build_mixture(entries, split: str, *, wrap: bool, shuffle: bool, **common) -> MixtureSource:
    """[[training.datasets]]: each source built as on its own, drawn by weight."""
    sources = [build_source(entry.dataset, entry.path, split=split, wrap=wrap, shuffle=shuffle,
                            key="training.datasets", **common) for entry in entries]
    return MixtureSource(sources, mixture_names(entries), [entry.weight for entry in entries])


def text_dataset(config) -> str:
    """The first dataset of the job that is text (needs a tokenizer), or ""."""
    t, v = config.training, config.validation
    datasets = [entry.dataset for entry in t.datasets] or [t.dataset]
    if v.enable and v.dataset:
        datasets.append(v.dataset)
    return next((d for d in datasets if d not in (*BUILT_IN, "shards")), "")


def build_sources(config, vocab_size: int):
    """(training source, validation source or None) for a JobConfig."""
    from trainer.data.tokenizer import configured_tokenizer

    tokenizer = configured_tokenizer(config.model, vocab_size, needed_by=text_dataset(config))
    t, v = config.training, config.validation
    common = dict(vocab_size=vocab_size, seed=data_seed(config), tokenizer=tokenizer, text_field=t.dataset_text_field,
                  validation_fraction=t.validation_fraction)
    if t.datasets:
        train = build_mixture(t.datasets, "train", wrap=t.dataset_end == "wrap", shuffle=t.shuffle, **common)
    else:
        stream = dict(lanes=t.stream_lanes, workers=t.stream_workers, prefetch=t.stream_prefetch)
        train = build_source(t.dataset, t.dataset_path, split="train", wrap=t.dataset_end == "wrap",
                             shuffle=t.shuffle, stream=stream, seq_len=t.seq_len, **common)
    if not v.enable:
        return train, None
    if t.datasets and not v.dataset:
        validation = build_mixture(t.datasets, "validation", wrap=True, shuffle=False, **common)
    elif v.dataset:
        validation = build_source(v.dataset, v.dataset_path, split="validation", wrap=True, key="validation",
                                  seq_len=v.seq_len or t.seq_len, **common)
    else:
        validation = build_source(t.dataset, t.dataset_path, split="validation", wrap=True,
                                  seq_len=v.seq_len or t.seq_len, **common)
    return train, validation
