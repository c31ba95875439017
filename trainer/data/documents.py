"""Documents of local text files, read one at a time (a file is never held whole).

Formats, by suffix (any case), each optionally compressed (.gz, .bz2, .xz, .zst):
- .jsonl: one JSON record per line; the document is the record's text field;
- .json: a JSON array of records, or one record per line;
- .parquet: one record per row;
- .txt: one document per blank-line separated paragraph.

A folder or glob is read completely: a file of any other kind is refused by name, never skipped.
Every source treats records alike: a record without the text field is an error naming the file
and line (the wrong `dataset_text_field`, most likely); a record whose text is null, not a string,
or blank is skipped and counted.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import itertools
import json
import lzma
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


class DataError(ValueError):
    """A problem with the user's data that they can fix; the message names the file or key."""


FORMATS = (".jsonl", ".json", ".parquet", ".txt")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def file_format(path: str) -> tuple[str, str] | None:
    """(format, compression or '') of a data file by its name, or None for another kind of file."""
    name = Path(path).name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    stem = name[: len(name) - len(compression)]
    fmt = next((f for f in FORMATS if stem.endswith(f)), None)
    if fmt is None or (fmt == ".parquet" and compression):
        return None
    return fmt, compression


def find_data_files(path: str, key: str = "training.dataset_path") -> list[str]:
    """A file, a folder (searched recursively, hidden files aside) or a glob -> its data files,
    sorted. Any file that is not a supported data file is an error naming it."""
    if any(ch in path for ch in "*?["):
        candidates = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    elif os.path.isdir(path):
        candidates = [str(p) for p in Path(path).rglob("*")
                      if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    elif os.path.isfile(path):
        candidates = [path]
    else:
        raise DataError(f"{key}: {path!r} does not exist")
    unsupported = sorted(f for f in candidates if file_format(f) is None)
    if unsupported:
        shown = ", ".join(unsupported[:5]) + (f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else "")
        raise DataError(f"{key}: {shown} {'is not a' if len(unsupported) == 1 else 'are not'} supported data "
                        f"file{'s' if len(unsupported) > 1 else ''} ({'/'.join(FORMATS)}, optionally "
                        f"{'/'.join(COMPRESSIONS)}); select the data files with a glob, e.g. '{path.rstrip('/')}/**/*.jsonl'")
    if not candidates:
        raise DataError(f"{key}: no {'/'.join(FORMATS)} files found at {path!r}")
    return sorted(candidates)


def open_text(path: str, compression: str) -> io.TextIOBase:
    if compression == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if compression == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8")
    if compression == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if compression == ".zst":
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True),
                                encoding="utf-8")
    return open(path, encoding="utf-8")


@dataclass
class ReadCounts:
    """What reading found: documents kept, records skipped (null, not a string, or blank) per file."""

    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, path: str) -> None:
        self.skipped[path] = self.skipped.get(path, 0) + 1

    def describe_skipped(self) -> str:
        return ", ".join(f"{path}: {n}" for path, n in sorted(self.skipped.items()))


FIELD_KEY = "training.dataset_text_field"  # the key messages name (command-line tools name their flag)


def record_text(record, text_field: str, where: str, counts: ReadCounts, path: str) -> str | None:
    """The text of one record, or None (counted) when it is null, not a string or blank."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object with field {text_field!r}, not {type(record).__name__}")
    if text_field not in record:
        raise DataError(f"{FIELD_KEY}: {where} has no field {text_field!r}; "
                        f"its fields are {', '.join(map(str, record)) or 'none'}")
    text = record[text_field]
    if not isinstance(text, str) or not text.strip():
        counts.skip(path)
        return None
    return text


def _json_lines(handle, path: str, text_field: str, counts: ReadCounts) -> Iterator[str]:
    for number, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number}: not JSON ({e.msg})") from None
        text = record_text(record, text_field, f"{path} line {number}", counts, path)
        if text is not None:
            yield text


def _json_file(handle, path: str, text_field: str, counts: ReadCounts) -> Iterator[str]:
    head = handle.read(1)
    while head and head.isspace():
        head = handle.read(1)
    if head != "[":  # records one per line, as .jsonl: read on line by line, not held whole
        yield from _json_lines(itertools.chain([head + handle.readline()], handle), path, text_field, counts)
        return
    try:
        records = json.loads(head + handle.read())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    for number, record in enumerate(records, 1):
        text = record_text(record, text_field, f"{path} record {number}", counts, path)
        if text is not None:
            yield text


def _paragraphs(handle, path: str, counts: ReadCounts) -> Iterator[str]:
    lines: list[str] = []
    for line in handle:
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).strip()
            lines = []
    if lines:
        yield "".join(lines).strip()


def _parquet(path: str, text_field: str, counts: ReadCounts) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for files that are not parquet
        raise DataError(f"{path}: cannot read as parquet: {e}") from None
    if text_field not in table.schema_arrow.names:
        raise DataError(f"{FIELD_KEY}: {path} has no field {text_field!r}; "
                        f"its fields are {', '.join(table.schema_arrow.names)}")
    row = 0
    for batch in table.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            if isinstance(text, str) and text.strip():
                yield text
            else:
                counts.skip(path)


def read_file(path: str, text_field: str, counts: ReadCounts) -> Iterator[str]:
    """The documents of one data file, in order."""
    fmt, compression = file_format(path) or (None, None)
    if fmt is None:
        raise DataError(f"{path}: not a supported data file ({'/'.join(FORMATS)}, optionally {'/'.join(COMPRESSIONS)})")
    if fmt == ".parquet":
        documents = _parquet(path, text_field, counts)
    else:
        documents = _read_text_format(path, fmt, compression, text_field, counts)
    for text in documents:
        counts.documents += 1
        yield text


def _read_text_format(path: str, fmt: str, compression: str, text_field: str, counts: ReadCounts) -> Iterator[str]:
    try:
        with open_text(path, compression) as handle:
            if fmt == ".jsonl":
                yield from _json_lines(handle, path, text_field, counts)
            elif fmt == ".json":
                yield from _json_file(handle, path, text_field, counts)
            else:
                yield from _paragraphs(handle, path, counts)
    except DataError:
        raise
    except Exception as e:  # what a corrupt or truncated file raises depends on its compression
        if not isinstance(e, (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError)) and type(e).__name__ != "ZstdError":
            raise
        raise DataError(f"{path}: cannot read: {type(e).__name__}: {e}") from None


def line_start(path: str, offset: int) -> int:
    """The first line start at or after byte `offset` of a file (its size when there is none)."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        f.readline()  # to the end of the line holding byte offset - 1
        return f.tell()


def read_jsonl_range(path: str, start: int, stop: int, text_field: str, counts: ReadCounts) -> Iterator[str]:
    """The documents of the lines of an uncompressed .jsonl file from byte `start` (a line start)
    up to `stop` (a line start or the end): a part of a file too large for one worker."""
    with open(path, "rb") as f:
        f.seek(start)
        position = start
        while position < stop:
            line = f.readline()
            if not line:
                break
            where, position = position, position + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path} byte {where}: not JSON ({getattr(e, 'msg', e)})") from None
            text = record_text(record, text_field, f"{path} byte {where}", counts, path)
            if text is not None:
                counts.documents += 1
                yield text


def read_files(files: list[str], text_field: str, counts: ReadCounts) -> Iterator[str]:
    for path in files:
        yield from read_file(path, text_field, counts)
