"""Checksums of a DCP checkpoint, recorded as it is saved and checked as it is read.

A flipped bit in a shard otherwise loads as a silently wrong weight: torch's zip files hold a
CRC-32 of each record, but torch never checks them when it reads. ChecksumWriter, torch's
FileSystemWriter plus checksums, has each rank hash every item as it hands the item to
torch.save (a tensor in a background thread, while the writer writes it); the coordinator gathers them with DCP's write results and writes `checksums.json`
beside `.metadata`, just before `.metadata` appears (so a checkpoint that looks complete has its
checksums). DCP's own files are unchanged: plain torch reads the checkpoint as before. The reader
(trainer.checkpoint.checked_reader.CheckedReader) checks each item it reads, so a load that reads part of a
file (another layout) checks exactly what it uses.

What is hashed, with CRC-32 (zlib: 3.7 GB/s on one core here, twice sha256 and 4 times blake2b,
and it releases the GIL; it catches every burst of up to 32 flipped bits and any other random
change but one in 4 billion, which is what a checksum beside the data can promise: it is no
signature, whoever can rewrite a shard can rewrite this file):
- a tensor item: its value, i.e. dtype and shape, then its bytes in row-major order. The reader
  hashes the tensor torch.load returned, which covers every byte that decides the value (the data
  and the dtype, shape, strides and byte order stored beside it) without reading the file twice;
- a non-tensor item (the data position, the step): its bytes as stored;
- `.metadata`: its bytes, checked before they are unpickled.

`checksums.json` (version 1), checksums as 8 hex digits:
    {"format": "dcp-checksums", "version": 1, "algorithm": "crc32",
     "metadata": {"size": 16358, "crc32": "5d3c9e01"},
     "files": {"__0_0.distcp": {"size": 81234, "items": [
         {"offset": 0, "length": 1193, "key": "model.0.weight", "chunk": [0, 0], "crc32": "0f1e2d3c"},
         {"offset": 1193, "length": 812, "key": "train_state", "chunk": null, "crc32": "..."}]}}}
`offset` and `length` locate the item in its file as `.metadata` does; `key` and `chunk` are its
DCP key and the chunk's offsets in the tensor (null for a non-tensor item).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, _FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

CHECKSUMS_FILE = "checksums.json"
METADATA_FILE = ".metadata"
FORMAT, VERSION, ALGORITHM = "dcp-checksums", 1, "crc32"
# Threads hashing the tensors of a save while the writer writes them: CRC-32 runs at about
# 3.5 GB/s per core, faster than a checkpoint is written, so two keep up with any writer.
HASHING_THREADS = 2


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's value: its dtype and shape, then its bytes in row-major order."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    header = f"{tensor.dtype}{list(tensor.shape)}".encode()
    data = tensor.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data, zlib.crc32(header))


def bytes_checksum(data: Any) -> int:
    return zlib.crc32(data)


@dataclass(frozen=True)
class ItemChecksum:
    key: str
    chunk: tuple[int, ...] | None
    length: int
    crc32: int


@dataclass(frozen=True)
class Checksums:
    """The content of a checksums.json: `.metadata`'s size and checksum, and per data file its
    size and its items by byte offset."""
    metadata_size: int
    metadata_crc32: int
    sizes: dict[str, int]
    items: dict[str, dict[int, ItemChecksum]]


class _Checksummed:
    """A write result's storage data with the item's checksum, on its way to the coordinator
    (DCP gathers the write results there); finish() takes the checksum off again."""

    def __init__(self, info: Any, crc32: int):
        self.info, self.crc32 = info, crc32


class ChecksumWriter(_FileSystemWriter):
    """torch's FileSystemWriter that also writes checksums.json. Pass it to dcp.save or
    dcp.async_save as storage_writer. It derives from FileSystemWriter's base, without the stager
    FileSystemWriter adds: given to dcp.async_save, it leaves the staging to DCP's default (or to
    the stager passed), as when async_save made its own writer."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _ChecksumsFirst(self._write_checksums)
        self._pending: dict | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with ThreadPoolExecutor(HASHING_THREADS, thread_name_prefix="checkpoint-crc32") as pool:
            hashing = _HashingPlanner(planner, pool)
            results = super().write_data(plan, hashing).wait()  # FileSystemWriter writes before it returns
            checksums = {index: crc.result() for index, crc in hashing.checksums.items()}
        done: Future = Future()
        done.set_result([replace(r, storage_data=_Checksummed(r.storage_data, checksums[r.index])) for r in results])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain, files = [], {}
        for rank_results in results:
            plain.append([])
            for result in rank_results:
                info, crc32 = result.storage_data.info, result.storage_data.crc32
                plain[-1].append(replace(result, storage_data=info))
                offsets = list(result.index.offset) if result.index.offset is not None else None
                files.setdefault(info.relative_path, []).append(
                    {"offset": info.offset, "length": info.length, "key": result.index.fqn, "chunk": offsets,
                     "crc32": f"{crc32:08x}"})
        if not self.use_collectives:  # rank-local metadata files (not used by the trainer): no checksums
            super().finish(metadata, plain)
            return
        self._pending = files
        super().finish(metadata, plain)  # writes .metadata; _ChecksumsFirst writes checksums.json first
        if self._pending is not None:  # a torch that wrote .metadata without renaming it into place
            self._write_checksums(Path(self.path) / METADATA_FILE)

    def _write_checksums(self, metadata_file: Path) -> None:
        if self._pending is None:
            return
        raw = metadata_file.read_bytes()
        files = {name: {"size": max(i["offset"] + i["length"] for i in items),
                        "items": sorted(items, key=lambda i: i["offset"])}
                 for name, items in sorted(self._pending.items())}
        document = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM,
                    "metadata": {"size": len(raw), "crc32": f"{bytes_checksum(raw):08x}"}, "files": files}
        final, partial = Path(self.path) / CHECKSUMS_FILE, Path(self.path) / f"{CHECKSUMS_FILE}.tmp"
        with open(partial, "w") as file:
            json.dump(document, file, separators=(",", ":"))
            file.flush()
            if self.sync_files:
                os.fsync(file.fileno())
        partial.replace(final)
        self._pending = None


class _ChecksumsFirst(FileSystem):
    """DCP's file system, which writes checksums.json (from the finished temporary metadata file)
    the moment before DCP renames `.metadata` into place: the checkpoint is never complete
    without its checksums."""

    def __init__(self, write_checksums):
        super().__init__()
        self.write_checksums = write_checksums

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if Path(new_path).name == METADATA_FILE:
            self.write_checksums(Path(path))
        super().rename(path, new_path)


class _HashingPlanner:
    """Stands in for the save planner while ChecksumWriter writes: hashes each item as the writer
    takes it, a tensor in a thread of `pool` while the writer serializes and writes the same
    tensor (zlib releases the GIL: the hashing costs no time where a core is free). A tensor on an
    accelerator is copied to the host here (the writer would copy it next) and handed on as that
    copy; everything else goes to the planner unchanged. `checksums`: item index -> a future of
    its CRC-32."""

    def __init__(self, planner: SavePlanner, pool: ThreadPoolExecutor):
        self.planner, self.pool = planner, pool
        self.checksums: dict = {}

    def resolve_data(self, item: WriteItem) -> Any:
        data = self.planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            with data.getbuffer() as view:  # released at once: the writer reads the BytesIO next
                self.checksums[item.index] = _done(bytes_checksum(view))
            return data
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        self.checksums[item.index] = self.pool.submit(tensor_checksum, tensor)
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)


def _done(value: int) -> ConcurrentFuture:
    future: ConcurrentFuture = ConcurrentFuture()
    future.set_result(value)
    return future


def parse_checksums(raw: bytes) -> Checksums:
    """The checksums in a checksums.json's bytes; ValueError saying what is wrong with them."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"not a checksums file (its format is not {FORMAT!r})")
    if document.get("version") != VERSION or document.get("algorithm") != ALGORITHM:
        raise ValueError(f"version {document.get('version')!r}, algorithm {document.get('algorithm')!r}: this "
                         f"trainer reads version {VERSION}, {ALGORITHM}")
    metadata, files = document.get("metadata"), document.get("files")
    if not isinstance(metadata, dict) or not isinstance(files, dict):
        raise ValueError("it lacks the 'metadata' or 'files' table")
    sizes, items = {}, {}
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("items"), list):
            raise ValueError(f"the entry of {name!r} has no list of items")
        sizes[name] = _count(entry.get("size"), f"{name}: size")
        items[name] = {}
        for item in entry["items"]:
            offset, checksum = _item(item, name)
            if offset in items[name]:
                raise ValueError(f"{name} lists two items at byte {offset}")
            items[name][offset] = checksum
    return Checksums(_count(metadata.get("size"), "metadata size"), _crc(metadata.get("crc32"), "metadata crc32"),
                     sizes, items)


def _item(item: Any, file: str) -> tuple[int, ItemChecksum]:
    if not isinstance(item, dict) or not isinstance(item.get("key"), str):
        raise ValueError(f"an item of {file} is not a table with a key")
    chunk = item.get("chunk")
    if chunk is not None and not (isinstance(chunk, list) and all(type(n) is int for n in chunk)):
        raise ValueError(f"{file}: the chunk of {item['key']!r} is not a list of integers")
    where = f"{file}: {item['key']!r}"
    return _count(item.get("offset"), f"{where} offset"), ItemChecksum(
        item["key"], tuple(chunk) if chunk is not None else None, _count(item.get("length"), f"{where} length"),
        _crc(item.get("crc32"), f"{where} crc32"))


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {value!r}, not a count of bytes")
    return value


def _crc(value: Any, what: str) -> int:
    if not isinstance(value, str) or len(value) != 8 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{what} is {value!r}, not 8 hex digits")
    return int(value, 16)
