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
import reprlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from trainer.data.documents import DataError

FORMAT = "llama-pretrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
OPEN_FILES = 64  # shard files a reader keeps open
# How a message quotes a manifest's value: whole, unless it is long (the file may hold anything).
QUOTE = reprlib.Repr()
QUOTE.maxstring = QUOTE.maxother = 120


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_paths(folder: Path, split: str, name: str) -> tuple[Path, Path]:
    return folder / split / f"{name}.tokens", folder / split / f"{name}.docs.npy"


def read_manifest(folder: str | Path, key: str = "training.dataset_path") -> dict:
    """A prepared folder's manifest, every field its readers use checked (the folder may come
    from anywhere); DataError naming the file and the field otherwise."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise DataError(f"{key}: {str(folder)!r} is not a folder of prepared shards "
                        "(write one with `python -m trainer.data.prepare`)")
    if not path.is_file():
        raise DataError(f"{key}: {folder} has no {MANIFEST}: not a prepared shard folder, or its preparation did "
                        "not finish (run `python -m trainer.data.prepare` again with the same arguments to complete it)")
    own_file(path, key)
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, an int of 5000 digits
        raise DataError(f"{path}: unreadable manifest ({str(e)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        found = manifest if isinstance(manifest, dict) else {}
        raise DataError(f"{path}: not a {FORMAT} v{VERSION} manifest (format {QUOTE.repr(found.get('format'))}, "
                        f"version {QUOTE.repr(found.get('version'))})")
    problem = manifest_problem(manifest)
    if problem:
        raise DataError(f"{path}: {problem}; the folder is damaged or was not written by trainer.data.prepare "
                        "(prepare it again)")
    return manifest


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _field(table, name: str, accepts, what: str, where: str) -> str | None:
    """Why table[name] is not valid (`accepts(value)` fails), or None."""
    if not isinstance(table, dict):
        return f"{where} is {QUOTE.repr(table)}, not an object"
    value = table.get(name, ...)
    if value is ... or not accepts(value):
        return f"{where}.{name} is {'missing' if value is ... else QUOTE.repr(value)}; expected {what}"
    return None


def splits_problem(splits, where: str) -> str | None:
    """Why {"train": {"documents": n, "tokens": n}, "validation": {...}} is not that, or None."""
    for split in SPLITS:
        problem = _field(splits, split, lambda v: isinstance(v, dict), "an object", where)
        for name in ("documents", "tokens"):
            problem = problem or _field(splits[split], name, _count, "a count >= 0", f"{where}.{split}")
        if problem:
            return problem
    return None


def manifest_problem(m: dict) -> str | None:
    """The first field of a manifest that its readers (the shard reader, the preflight) could
    not use, or None."""
    checks = [
        (m, "dtype", lambda v: v in ("<u2", "<u4"), "'<u2' or '<u4'", "manifest"),
        (m, "tokenizer", lambda v: isinstance(v, dict), "an object", "manifest"),
        (m, "validation_fraction", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1,
         "a number in [0, 1)", "manifest"),
        (m, "digest", lambda v: isinstance(v, str), "a string", "manifest"),
        (m, "sources", lambda v: isinstance(v, list), "a list", "manifest"),
    ]
    problem = next((p for p in (_field(*check) for check in checks) if p), None)
    if problem:
        return problem
    tokenizer = m["tokenizer"]
    vocab_limit = 1 << (16 if m["dtype"] == "<u2" else 32)
    for name, accepts, what in (("file", lambda v: isinstance(v, str), "a string"),
                                ("sha256", lambda v: isinstance(v, str), "a string"),
                                ("vocab_size", lambda v: _count(v) and 1 <= v <= vocab_limit,
                                 f"a count of ids in [1, {vocab_limit}] (dtype {m['dtype']})")):
        problem = _field(tokenizer, name, accepts, what, "tokenizer")
        if problem:
            return problem
    for name in ("bos_id", "eos_id"):
        problem = _field(tokenizer, name, lambda v: v is None or (_count(v) and v < tokenizer["vocab_size"]),
                         f"null or an id below vocab_size {tokenizer['vocab_size']}", "tokenizer")
        if problem:
            return problem
    names = set()
    for index, source in enumerate(m["sources"]):
        where = f"sources[{index}]"
        problem = _field(source, "name", _shard_name, "a file name (no folder, no '..')", where) or splits_problem(
            source.get("splits"), f"{where}.splits")
        if problem:
            return problem
        if source["name"] in names:
            return f"{where}.name {QUOTE.repr(source['name'])} names two sources"
        names.add(source["name"])
    problem = splits_problem(m.get("totals"), "totals")
    if problem:
        return problem
    for split in SPLITS:  # the preflight reads the totals, the reader the sources: they must agree
        for name in ("documents", "tokens"):
            summed = sum(source["splits"][split][name] for source in m["sources"])
            if m["totals"][split][name] != summed:
                return f"totals.{split}.{name} is {m['totals'][split][name]}, but its sources hold {summed}"
    return None


def _shard_name(name) -> bool:
    """A name prepare gives a part: a file name in the split's folder, with room for its suffix."""
    return (isinstance(name, str) and name not in ("", ".", "..") and name.isprintable()
            and not any(c in name for c in "/\\") and len(name.encode()) <= 200)


def own_file(path: Path, key: str) -> None:
    """DataError when `path` is a link that leaves the prepared folder (a link to another disk
    is the folder's, or a split folder's, own: only the file itself is looked at)."""
    if path.is_symlink():
        folder = path.parent.parent if path.parent.name in SPLITS else path.parent
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError) as e:  # RuntimeError: links round in a loop
            raise DataError(f"{key}: {path} is a link that leads to no file ({e})") from None
        if not target.is_relative_to(folder.resolve()):
            raise DataError(f"{key}: {path} is a link to {target}, outside the prepared folder {folder}; copy the "
                            "file there instead")


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
            own_file(tokens_path, key)
            own_file(docs_path, key)
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
        tokens = np.frombuffer(data, dtype=self.dtype)
        # A damaged shard's id past the vocabulary would index past the embedding (a device assert on a GPU).
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            at = int(tokens.argmax())
            raise DataError(f"shard {shard_paths(self.folder, self.split, self.names[index])[0]} holds token id "
                            f"{tokens[at]} at token {start + at}, beyond the {self.vocab_size} ids of the tokenizer it "
                            "was prepared with: the folder is damaged; prepare it again")
        return tokens

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
