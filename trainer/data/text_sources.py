"""Text tokenized as it is read: local files tokenized at start, and Hugging Face datasets streamed.

Documents are tokenized ([BOS] text [EOS]), concatenated, and cut into rows of `length` tokens
(non-overlapping). Row i is therefore a fixed function of the data, the tokenizer and the row
length, whatever the parallel layout.

- Local files (`training.dataset = "files"`) are tokenized once at start into memory
  (trainer.data.finite_sources.TokenArraySource): for small corpora; large ones are prepared
  into shards once (trainer.data.prepare).
- Hugging Face datasets by name are streamed: rows come in order, and every data-parallel rank
  reads the whole stream (keeping only its rows), so the stream position is the same on all
  ranks and a run resumes under any layout. That costs each rank the tokenization of the global
  batch.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from trainer.data.documents import DataError, ReadCounts, record_text
from trainer.data.finite_sources import DataExhausted

logger = logging.getLogger(__name__)

HUB_ALIASES = {  # short names -> (hub id, config)
    "c4": ("allenai/c4", "en"),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}


def tokenize_documents(documents: list[str], tokenizer, chunk: int = 1024) -> np.ndarray:
    """[BOS] text [EOS] of every document, concatenated, in the smallest dtype the vocabulary fits."""
    from trainer.data.shards import token_dtype

    dtype = token_dtype(getattr(tokenizer, "vocab_size", 1 << 32))
    pieces = [np.asarray(ids, dtype=dtype)
              for start in range(0, len(documents), chunk)
              for ids in tokenizer.encode_batch_documents(documents[start:start + chunk])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


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
        self.docs_in_epoch = 0  # records of this epoch read
        self.carry = np.zeros(0, dtype=np.int32)  # their tokens not yet in a row
        self.counts = ReadCounts()
        self.stream_position = ""  # the dataset's own state (JSON) after docs_in_epoch records
        self._stream = None
        self._iterator = None

    def _documents(self):
        """Document texts from the current position on, epoch after epoch. docs_in_epoch counts
        the records read (skipped ones too), up to the document last handed out."""
        while True:
            stream = self.open_stream()
            if self.docs_in_epoch and self.stream_position and hasattr(stream, "load_state_dict"):
                stream.load_state_dict(json.loads(self.stream_position))  # straight to the record
            elif self.docs_in_epoch:
                stream = stream.skip(self.docs_in_epoch)  # a checkpoint without the stream's position
            self._stream = stream
            seen_any = self.docs_in_epoch > 0
            for record in stream:
                self.docs_in_epoch += 1
                seen_any = True
                text = record_text(record, self.text_field, f"{self.name} record {self.docs_in_epoch}",
                                   self.counts, self.name)
                if text is None:
                    if self.counts.skipped[self.name] == 1:
                        logger.warning("%s: record %d has no text (null, not a string, or blank): skipped; such "
                                       "records are skipped and counted in run_meta.json", self.name, self.docs_in_epoch)
                    continue
                yield text
            if not seen_any:
                raise DataError(f"{self.name}: the dataset has no documents")
            if not self.wrap:
                raise DataExhausted(f"{self.name}: the stream ended (training.dataset_end = 'stop')")
            self.epoch, self.docs_in_epoch, self.stream_position = self.epoch + 1, 0, ""
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
            parts.append(ids)
            have += len(ids)
        tokens = np.concatenate(parts)
        self.carry = tokens[needed:]
        self.next_row = first_row + count
        return tokens[skipped:needed].reshape(count, length).astype(np.int64)

    def epoch_of(self, row: int, length: int) -> int:
        return self.epoch

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_id", None)

    def state_dict(self) -> dict:
        """The position: rows and records consumed, tokens carried into the next row, and the
        dataset's own state, from which a resume opens the stream at the next record (in the
        middle of a data file, without reading the files before it)."""
        if self._stream is not None and self._iterator is not None and hasattr(self._stream, "state_dict"):
            self.stream_position = json.dumps(self._stream.state_dict())
        return {"next_row": self.next_row, "epoch": self.epoch, "docs_in_epoch": self.docs_in_epoch,
                "carry": self.carry.tolist(), "stream_position": self.stream_position}

    def load_state_dict(self, state: dict) -> None:
        self.next_row, self.epoch = int(state["next_row"]), int(state["epoch"])
        self.docs_in_epoch = int(state["docs_in_epoch"])
        self.carry = np.asarray(state["carry"], dtype=np.int32)
        self.stream_position = state.get("stream_position", "")
        self._stream, self._iterator = None, None

    def describe(self) -> dict:
        return {"source": self.name, "streaming": True, "skipped_records": sum(self.counts.skipped.values())}

    def fingerprint(self) -> dict:
        return {"source": self.name, "tokenizer_sha256": getattr(self.tokenizer, "sha256", None)}


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
