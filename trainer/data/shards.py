"""Pre-tokenized token shards: the on-disk format, and reading it.

A prepared folder (written by `python -m trainer.data.prepare`) holds, per split:

    <folder>/manifest.json                 written last; the folder is complete only with it
    <folder>/<split>/<name>.tokens         the split's tokens of one source file: raw little-endian
                                           uint16 (vocabularies up to 65,536) or uint32
    <folder>/<split>/<name>.docs.npy       int64 document start offsets in that file, plus the end

The manifest names the format version, the token dtype, the tokenizer (file, SHA-256, size, BOS
and EOS ids), the held-out fraction, and per source file its size, SHA-256, documents, tokens and
records skipped. A split is the concatenation of its shards in the manifest's order. Opening it
reads the manifest and checks each shard's size, so it costs the same for a megabyte and a
terabyte. Sequences are read with positional reads (os.pread) rather than a memory map: on Linux
with large page-cache folios, every page fault of a map brings up to 2 MB into the process's
resident set, so a rank reading random sequences of a 5 GB shard set grew by 2.4 GB after 1,600
sequences (benchmarks/data_shards.py); positional reads keep it flat, the page cache shared by
all ranks of a machine holding what is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from trainer.data.documents import DataError

FORMAT = "llama-pretrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
OPEN_FILES = 64  # shard files a reader keeps open


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_paths(folder: Path, split: str, name: str) -> tuple[Path, Path]:
    return folder / split / f"{name}.tokens", folder / split / f"{name}.docs.npy"


def read_manifest(folder: str | Path, key: str = "training.dataset_path") -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise DataError(f"{key}: {str(folder)!r} is not a folder of prepared shards "
                        "(write one with `python -m trainer.data.prepare`)")
    if not path.is_file():
        raise DataError(f"{key}: {folder} has no {MANIFEST}: not a prepared shard folder, or its preparation did "
                        "not finish (run `python -m trainer.data.prepare` again with the same arguments to complete it)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"{path}: not a {FORMAT} v{VERSION} manifest (format {manifest.get('format')!r}, "
                        f"version {manifest.get('version')!r})")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """The identity of a prepared folder's content: its tokenizer, dtype, split rule and every
    source file's hash and token counts (not where or when it was written)."""
    content = {k: manifest[k] for k in ("dtype", "tokenizer_sha256", "validation_fraction")}
    content["sources"] = [{k: s[k] for k in ("sha256", "splits")} for s in manifest["sources"]]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


class ShardSet:
    """One split of a prepared folder as one token array: `tokens(start, stop)` reads across
    shard boundaries."""

    def __init__(self, folder: str | Path, split: str, key: str = "training.dataset_path"):
        self._files: OrderedDict[int, int] = OrderedDict()  # shard index -> open file descriptor
        self.folder, self.split = Path(folder), split
        self.manifest = read_manifest(folder, key)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.names, counts = [], []
        for source in self.manifest["sources"]:
            count = int(source["splits"][split]["tokens"])
            if count:
                self.names.append(source["name"])
                counts.append(count)
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        for index, name in enumerate(self.names):
            tokens_path, docs_path = shard_paths(self.folder, split, name)
            expected = counts[index] * self.dtype.itemsize
            if not tokens_path.is_file() or tokens_path.stat().st_size != expected:
                found = tokens_path.stat().st_size if tokens_path.is_file() else "missing"
                raise DataError(f"{key}: shard {tokens_path} should hold {expected} bytes ({counts[index]} tokens) "
                                f"but is {found}: the folder is damaged; prepare it again")
            if not docs_path.is_file():
                raise DataError(f"{key}: shard index {docs_path} is missing: the folder is damaged; prepare it again")

    @property
    def token_count(self) -> int:
        return int(self.offsets[-1])

    def _descriptor(self, index: int) -> int:
        """An open file of shard `index` (at most OPEN_FILES stay open)."""
        if index in self._files:
            self._files.move_to_end(index)
            return self._files[index]
        if len(self._files) >= OPEN_FILES:
            os.close(self._files.popitem(last=False)[1])
        path, _ = shard_paths(self.folder, self.split, self.names[index])
        self._files[index] = os.open(path, os.O_RDONLY)
        return self._files[index]

    def _read(self, index: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of shard `index`."""
        size = self.dtype.itemsize
        wanted, data = (stop - start) * size, b""
        while len(data) < wanted:  # pread may return less than asked
            chunk = os.pread(self._descriptor(index), wanted - len(data), start * size + len(data))
            if not chunk:
                raise DataError(f"shard {self.names[index]} of {self.folder} ended early: the folder is damaged")
            data += chunk
        return np.frombuffer(data, dtype=self.dtype)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split, as int64."""
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces, position = [], start
        while position < stop:
            shard_start, shard_stop = int(self.offsets[first]), int(self.offsets[first + 1])
            end = min(stop, shard_stop)
            pieces.append(self._read(first, position - shard_start, end - shard_start))
            position, first = end, first + 1
        return np.concatenate(pieces).astype(np.int64)

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self):
        self.close()

    def describe(self) -> dict:
        return {"shards": len(self.names), "tokens": self.token_count, "dtype": self.dtype.name,
                "tokenizer": self.manifest["tokenizer"]["file"]}
