"""Token sources made of tokenized text documents: local files and Hugging Face datasets.

Documents are tokenized ([BOS] text [EOS]), concatenated, and cut into rows of `length` tokens
(non-overlapping). Row i is therefore a fixed function of the data, the tokenizer and the row
length, whatever the parallel layout.

- Local files (`training.dataset = "files"`) are read whole with `datasets` and tokenized once:
  random access to any row.
- Hugging Face datasets by name are streamed: rows come in order, and every data-parallel rank
  reads the whole stream (keeping only its rows), so the stream position is the same on all
  ranks and a run resumes under any layout. That costs each rank the tokenization of the global
  batch; for large runs, pre-tokenize to local files.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HUB_ALIASES = {  # short names -> (hub id, config)
    "c4": ("allenai/c4", "en"),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}


class DataError(ValueError):
    """A problem with the user's data that they can fix; the message names the file or key."""


class DataExhausted(RuntimeError):
    """A finite dataset ended and the configuration says to stop rather than wrap around."""


# ---------------------------------------------------------------------------------------------
# Local files


def find_data_files(path: str) -> list[str]:
    """A file, a directory (searched recursively) or a glob -> the data files, sorted."""
    if any(ch in path for ch in "*?["):
        candidates = glob.glob(path, recursive=True)
    elif os.path.isdir(path):
        candidates = [str(p) for p in Path(path).rglob("*")]
    elif os.path.isfile(path):
        candidates = [path]
    else:
        raise DataError(f"training.dataset_path: {path!r} does not exist")
    files = sorted(f for f in candidates if os.path.isfile(f) and Path(f).suffix in FILE_BUILDERS)
    if not files:
        raise DataError(f"training.dataset_path: no {', '.join(FILE_BUILDERS)} files found at {path!r}")
    return files


def read_documents(files: list[str], text_field: str) -> list[str]:
    """Documents of local files: blank-line separated paragraphs of .txt files, one record each
    of .jsonl/.json/.parquet files (its `text_field`)."""
    import datasets

    datasets.disable_progress_bars()
    documents: list[str] = []
    for file in files:
        builder = FILE_BUILDERS[Path(file).suffix]
        options = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            table = datasets.load_dataset(builder, data_files=[file], split="train", **options)
        except Exception as e:  # datasets raises many types for unreadable files
            raise DataError(f"training.dataset_path: cannot read {file}: {type(e).__name__}: {e}") from None
        field = "text" if builder == "text" else text_field
        if field not in table.column_names:
            raise DataError(f"training.dataset_text_field: {file} has no field {field!r}; "
                            f"its fields are {', '.join(table.column_names)}")
        texts = [t for t in table[field] if isinstance(t, str) and t.strip()]
        documents.extend(t.strip() if builder == "text" else t for t in texts)  # paragraphs lose their newline
    return documents


def tokenize_documents(documents: list[str], tokenizer, chunk: int = 1024) -> np.ndarray:
    pieces = [np.asarray(ids, dtype=np.int32)
              for start in range(0, len(documents), chunk)
              for ids in tokenizer.encode_batch_documents(documents[start:start + chunk])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class TokenArraySource:
    """Rows of a finite token array, with random access. Past the end it wraps around (epoch
    i // rows_per_epoch), or raises DataExhausted when wrap is False."""

    random_access = True
    entropy_floor = None

    def __init__(self, tokens: np.ndarray, *, name: str, wrap: bool = True):
        self.tokens, self.name, self.wrap = tokens, name, wrap

    def rows_per_epoch(self, length: int) -> int:
        return len(self.tokens) // length

    def epoch_of(self, row: int, length: int) -> int:
        return row // max(self.rows_per_epoch(length), 1)

    def check_available(self, last_row: int, length: int) -> None:
        """DataError when the data holds no whole row; DataExhausted when `last_row` is past the
        end and the source does not wrap."""
        per_epoch = self.rows_per_epoch(length)
        if per_epoch == 0:
            raise DataError(f"{self.name}: {len(self.tokens)} tokens, fewer than one sequence of {length}")
        if not self.wrap and last_row >= per_epoch:
            raise DataExhausted(f"{self.name}: the dataset ends after {per_epoch} sequences of {length} tokens "
                                f"(training.dataset_end = 'stop')")

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        self.check_available(first_row + count - 1, length)
        per_epoch = self.rows_per_epoch(length)
        index = (np.arange(first_row, first_row + count) % per_epoch)[:, None] * length + np.arange(length)
        return self.tokens[index].astype(np.int64)

    def describe(self) -> dict:
        return {"source": self.name, "tokens": int(len(self.tokens))}


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets, streamed


class StreamingTextSource:
    """Rows from a stream of documents, in order only. State: documents consumed and the tokens
    carried over into the next row, so a restored source continues with the same rows."""

    random_access = False
    entropy_floor = None

    def __init__(self, open_stream, tokenizer, *, text_field: str, name: str, wrap: bool = True):
        self.open_stream, self.tokenizer, self.text_field = open_stream, tokenizer, text_field
        self.name, self.wrap = name, wrap
        self.next_row = 0
        self.epoch = 0
        self.docs_in_epoch = 0  # documents of this epoch already tokenized
        self.carry = np.zeros(0, dtype=np.int32)  # their tokens not yet in a row
        self._iterator = None

    def _documents(self):
        """Document texts from the current position on, epoch after epoch."""
        while True:
            stream = self.open_stream()
            if self.docs_in_epoch:
                stream = stream.skip(self.docs_in_epoch)
            seen_any = self.docs_in_epoch > 0
            for record in stream:
                if self.text_field not in record:
                    raise DataError(f"training.dataset_text_field: {self.name} records have no field "
                                    f"{self.text_field!r}; fields: {', '.join(record)}")
                seen_any = True
                yield record[self.text_field]
            if not seen_any:
                raise DataError(f"{self.name}: the dataset has no documents")
            if not self.wrap:
                raise DataExhausted(f"{self.name}: the stream ended (training.dataset_end = 'stop')")
            self.epoch, self.docs_in_epoch = self.epoch + 1, 0
            logger.info("%s: starting epoch %d", self.name, self.epoch)

    def rows(self, first_row: int, count: int, length: int) -> np.ndarray:
        if first_row < self.next_row:
            raise ValueError(f"{self.name}: streamed rows must be read in order (asked {first_row}, at {self.next_row})")
        if self._iterator is None:
            self._iterator = self._documents()
        skipped = (first_row - self.next_row) * length
        needed = skipped + count * length
        parts, have = [self.carry], len(self.carry)
        while have < needed:
            ids = np.asarray(self.tokenizer.encode_document(next(self._iterator)), dtype=np.int32)
            self.docs_in_epoch += 1
            parts.append(ids)
            have += len(ids)
        tokens = np.concatenate(parts)
        self.carry = tokens[needed:]
        self.next_row = first_row + count
        return tokens[skipped:needed].reshape(count, length).astype(np.int64)

    def epoch_of(self, row: int, length: int) -> int:
        return self.epoch

    def state_dict(self) -> dict:
        return {"next_row": self.next_row, "epoch": self.epoch, "docs_in_epoch": self.docs_in_epoch,
                "carry": self.carry.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.next_row, self.epoch = int(state["next_row"]), int(state["epoch"])
        self.docs_in_epoch = int(state["docs_in_epoch"])
        self.carry = np.asarray(state["carry"], dtype=np.int32)
        self._iterator = None

    def describe(self) -> dict:
        return {"source": self.name, "streaming": True}


def hub_stream_opener(dataset: str, dataset_path: str, split: str):
    """A function opening the named dataset as a stream. dataset_path, when set, is a local copy
    (a folder of data files) loaded through the same `load_dataset` call instead of the hub."""
    import datasets

    hub_id, config = HUB_ALIASES.get(dataset, (dataset, None))
    location = dataset_path or hub_id

    def open_stream():
        try:
            if dataset_path:
                return datasets.load_dataset(location, split=split, streaming=True)
            return datasets.load_dataset(location, config, split=split, streaming=True)
        except Exception as e:
            raise DataError(f"training.dataset: cannot open {location!r} split {split!r}: {type(e).__name__}: {e}") from None

    return open_stream
