"""Reading a DCP checkpoint without running code from it, and refusing a corrupted one.

torch's FileSystemReader reads a checkpoint's `.metadata` with pickle.load, and its load planner
reads each non-tensor item (the data loader position, the step, the LR schedule) with
torch.load(weights_only=False). Both run whatever a crafted file asks for, such as os.system,
and checkpoints are passed between people (seed checkpoints, step folders to start from).

CheckedReader is a FileSystemReader that refuses such files: `.metadata` is unpickled by
trainer/checkpoint/safe_unpickle.py (load_metadata), and each non-tensor item must load with
torch.load(weights_only=True) before torch's planner reads it. Tensors torch already reads with
weights_only=True. It also checks what it reads against the checksums the checkpoint recorded
when it was saved (trainer/checkpoint/checksums.py), and names the file of a truncated shard.
"""

from __future__ import annotations

import io
import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainer.checkpoint.checksums import (CHECKSUMS_FILE, HASHING_THREADS, Checksums, bytes_checksum, parse_checksums,
                                         tensor_checksum)
from trainer.checkpoint.safe_unpickle import CorruptCheckpointError, UnsafeCheckpointError, metadata_from_bytes

__all__ = ["CheckedReader", "CorruptCheckpointError", "UnsafeCheckpointError", "load_metadata"]

logger = logging.getLogger(__name__)


def load_metadata(path: str | os.PathLike) -> Metadata:
    """The Metadata of a DCP `.metadata` file, read without running code from it."""
    return metadata_from_bytes(Path(path).read_bytes(), str(path))


class CheckedReader(FileSystemReader):
    """torch's FileSystemReader, reading `.metadata` with metadata_from_bytes and each item with
    checks: a non-tensor item must load with weights_only=True before torch's planner unpickles
    it, and with `verify` every item (and `.metadata`) must match the checkpoint's checksums.json
    (trainer/checkpoint/checksums.py). A checkpoint without one (saved before checksums were
    recorded) loads unchecked. Pass it to dcp.load as storage_reader."""

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        super().__init__(path)
        self.verify = verify
        self._checksums: Checksums | None = None
        self._checksums_read = False

    def checksums(self) -> Checksums | None:
        """The checkpoint's checksums (read once), or None: not verifying, or none recorded."""
        if not self.verify or self._checksums_read:
            return self._checksums
        file = Path(self.path) / CHECKSUMS_FILE
        try:
            raw = file.read_bytes()
        except FileNotFoundError:
            logger.debug("%s has no %s (saved before checksums were recorded): reading it unchecked",
                         self.path, CHECKSUMS_FILE)
            raw = None
        if raw is not None:
            try:
                self._checksums = parse_checksums(raw)
            except ValueError as e:
                raise CorruptCheckpointError(f"{file}: {e}; the file is corrupted or was not written by this "
                                             "trainer (checkpoint.verify_checksums = false loads without it)") from None
        self._checksums_read = True
        return self._checksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader.read_metadata (torch 2.13) does, but with the restricted unpickler:
        # dcp.load asks for `__<rank>.metadata` (rank-local metadata) when `.metadata` fails.
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        raw = path.read_bytes()
        checksums = self.checksums() if rank is None else None
        if checksums is not None and (len(raw), bytes_checksum(raw)) != (checksums.metadata_size,
                                                                         checksums.metadata_crc32):
            raise CorruptCheckpointError(f"{path}: checksum mismatch: {_CHANGED}")
        metadata = metadata_from_bytes(raw, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # torch's FileSystemReader.read_data gives no hook between reading an item and using it,
        # so the reading is done here: per file, each item read, checked, then handed on.
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            _FileRead(self, Path(self.path) / name, items, planner).run()
        done: Future = Future()
        done.set_result(None)
        return done


_CHANGED = "the file was changed or corrupted after it was saved (checkpoint.verify_checksums = false loads it anyway)"


class _FileRead:
    """Reads the items of one data file that a load asked for: each is checked against its
    checksum before it is used; every mismatch in the file is named in one error. A tensor is
    hashed in a thread while the next one is read (zlib releases the GIL), and copied into the
    state only once its checksum matched; at most PENDING tensors wait for theirs."""

    PENDING = 2

    def __init__(self, reader: CheckedReader, file: Path, items: list[ReadItem], planner: LoadPlanner):
        self.reader, self.file, self.items, self.planner = reader, file, items, planner
        self.checksums = reader.checksums()
        self.mismatched: list[str] = []
        self.pending: deque = deque()  # (item, tensor, recorded crc32, future of its crc32)

    def info(self, item: ReadItem) -> _StorageInfo:
        return self.reader.storage_data[item.storage_index]

    def run(self) -> None:
        try:
            stream = open(self.file, "rb")
        except OSError as e:
            raise CorruptCheckpointError(f"{self.file}: cannot be opened ({e.strerror}); .metadata lists "
                                         f"{_names(item.storage_index.fqn for item in self.items)} in it") from None
        with stream, ThreadPoolExecutor(HASHING_THREADS, thread_name_prefix="checkpoint-crc32") as self.pool:
            self.check_size(os.fstat(stream.fileno()).st_size)
            for item in self.items:
                self.read(stream, item)
            self.settle(0)
        if self.mismatched:
            tensors = {i.storage_index.fqn for i in self.items if i.type != LoadItemType.BYTE_IO}
            kind = "tensors" if set(self.mismatched) <= tensors else "items"
            raise CorruptCheckpointError(f"{self.file}: checksum mismatch in {kind} {_names(self.mismatched)}: "
                                         f"{_CHANGED}")

    def check_size(self, size: int) -> None:
        short = [item for item in self.items if self.info(item).offset + self.info(item).length > size]
        if short:
            end = max(self.info(item).offset + self.info(item).length for item in short)
            raise CorruptCheckpointError(
                f"{self.file}: truncated: it holds {size} bytes, .metadata places "
                f"{_names(item.storage_index.fqn for item in short)} up to byte {end}; the file was cut short "
                "after it was saved (an interrupted copy, a full disk)")

    def read(self, stream, item: ReadItem) -> None:
        info = self.info(item)
        view = self.reader.transforms.transform_load_stream(
            item, info.transform_descriptors or (), self.reader._slice_file(stream, info))
        if item.type == LoadItemType.BYTE_IO:
            data = view.read()
            recorded = self.recorded(item, info)
            if recorded is None or bytes_checksum(data) == recorded:
                _check_plain_value(data, self.file, item)
                self.planner.load_bytes(item, io.BytesIO(data))
            else:
                self.mismatched.append(item.storage_index.fqn)
            return
        if not view.seekable():  # a decompressing transform: torch.load seeks
            view = io.BytesIO(view.read())
        tensor = self.load_tensor(view, item)
        recorded = self.recorded(item, info)
        if recorded is None:
            self.commit(item, tensor)
            return
        self.pending.append((item, tensor, recorded, self.pool.submit(tensor_checksum, tensor)))
        self.settle(self.PENDING)

    def settle(self, waiting: int) -> None:
        """Check the hashed tensors (oldest first) until at most `waiting` wait; commit the matching."""
        while len(self.pending) > waiting:
            item, tensor, recorded, checksum = self.pending.popleft()
            if checksum.result() == recorded:
                self.commit(item, tensor)
            else:
                self.mismatched.append(item.storage_index.fqn)

    def commit(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy the checked tensor (its part this load asked for) into the state being loaded."""
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = self.planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(f"{self.file}: tensor {item.storage_index.fqn} at byte {self.info(item).offset} "
                                         f"has shape {list(tensor.shape)}, .metadata says {list(target.shape)}")
        target.copy_(tensor)
        self.planner.commit_tensor(item, target)

    def load_tensor(self, value, item: ReadItem) -> torch.Tensor:
        try:
            tensor = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # whatever the bytes: the file is not what .metadata says it is
            raise CorruptCheckpointError(
                f"{self.file}: tensor {item.storage_index.fqn} at byte {self.info(item).offset} cannot be read "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the file is corrupted or is not "
                "this checkpoint's") from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{self.file}: item {item.storage_index.fqn} holds a "
                                         f"{type(tensor).__name__}, not a tensor")
        return tensor

    def recorded(self, item: ReadItem, info: _StorageInfo) -> int | None:
        """The item's recorded checksum (None without checksums); refused when the checkpoint's
        checksums.json records none for it at its place."""
        if self.checksums is None:
            return None
        recorded = self.checksums.items.get(info.relative_path, {}).get(info.offset)
        index = item.storage_index
        chunk = tuple(index.offset) if index.offset is not None else None
        if recorded is None or (recorded.key, recorded.chunk, recorded.length) != (index.fqn, chunk, info.length):
            raise CorruptCheckpointError(
                f"{self.file}: {CHECKSUMS_FILE} records no checksum for {index.fqn} at byte {info.offset}: it does "
                "not describe this checkpoint (checkpoint.verify_checksums = false loads it anyway)")
        return recorded.crc32


def _check_plain_value(raw: bytes, file: Path, item: ReadItem) -> None:
    """torch's planners unpickle a non-tensor item with torch.load(weights_only=False), so the
    item must first load with weights_only=True (plain values, containers and tensors only)."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # any refusal: the planner's unrestricted load must not see this item
        raise UnsafeCheckpointError(
            f"{file}: refusing to load checkpoint item '{item.storage_index.fqn}'{_unsafe_globals(raw)}: "
            "a DCP checkpoint's non-tensor items hold plain values only; this file was crafted or is not a "
            f"DCP checkpoint ({type(e).__name__})") from None


def _unsafe_globals(raw: bytes) -> str:
    """' (it names ...)' with the globals torch's weights_only load refuses, when it can list them."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
    except Exception:  # not a torch.save file at all: the caller's message says enough
        return ""
    return f" (it names {', '.join(repr(n) for n in names)})" if names else ""


def _names(names, shown: int = 5) -> str:
    names = list(dict.fromkeys(names))
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
