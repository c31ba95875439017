"""Reading a DCP checkpoint without running code from it.

torch's FileSystemReader reads a checkpoint's `.metadata` with pickle.load, and its load planner
reads each non-tensor item (the data loader position, the step, the LR schedule) with
torch.load(weights_only=False). Both run whatever a crafted file asks for, such as os.system,
and checkpoints are passed between people (seed checkpoints, step folders to start from).

CheckedReader is a FileSystemReader that refuses such files: `.metadata` is unpickled admitting
only the classes DCP writes there (load_metadata), and each non-tensor item must load with
torch.load(weights_only=True) before torch's planner reads it. Tensors torch already reads with
weights_only=True.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _MEM_FORMAT_ENCODING,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to load something a DCP checkpoint never holds; the message names
    the file."""


def _admitted_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every global a DCP `.metadata` of torch 2.13 refers to: the
    metadata dataclasses, torch.Size (offsets and sizes), dtypes, the layout (pickled as a call
    of torch.serialization._get_layout with its name), the memory-format encoding, and the
    PosixPath the writer keeps as storage_meta.checkpoint_id. Each is harmless to call with any
    arguments: it only builds a value. (`builtins.getattr`, with which some Python releases
    pickle enum members, is admitted separately and only for those: _enum_member_getter.)"""
    classes = [Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
               MetadataIndex, StorageMeta, _StorageInfo, _MEM_FORMAT_ENCODING, torch.Size, pathlib.PosixPath]
    admitted = {(c.__module__, c.__qualname__): c for c in classes}
    admitted[("pathlib", "PosixPath")] = pathlib.PosixPath  # its name in files of any Python version
    admitted[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    admitted |= {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return admitted


_ADMITTED = _admitted_globals()
# Enum classes whose members a metadata file may name. Some Python releases (3.11.2, for one)
# pickle an enum member as the call getattr(EnumClass, "NAME") rather than by value.
_ADMITTED_ENUMS = (_MEM_FORMAT_ENCODING,)


def _enum_member_getter(file: str):
    """What `builtins.getattr` may do in a metadata file: return a member, by name, of an
    admitted enum class; any other use is refused (getattr could reach any attribute)."""

    def member(owner, name):
        if owner in _ADMITTED_ENUMS and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        raise UnsafeCheckpointError(
            f"{file}: refusing to load 'builtins.getattr' of {getattr(owner, '__qualname__', type(owner).__name__)}."
            f"{name}: a DCP metadata file names only members of its own enums; this file was crafted or is not "
            "a DCP checkpoint")

    return member


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the globals of _ADMITTED. pickle looks up every class or function a file
    names (GLOBAL, STACK_GLOBAL, extension codes) through find_class, so nothing else can be
    called. Persistent ids, which DCP metadata never uses, are refused by pickle itself."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member_getter(self.name)
        found = _ADMITTED.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.name}: refusing to load '{module}.{name}': a DCP metadata file holds only checkpoint "
                "metadata; this file was crafted or is not a DCP checkpoint")
        return found


def load_metadata(path: str | os.PathLike) -> Metadata:
    """The Metadata of a DCP `.metadata` file, read without running code from it."""
    with open(path, "rb") as file:
        metadata = _MetadataUnpickler(file, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


class CheckedReader(FileSystemReader):
    """torch's FileSystemReader, reading `.metadata` with load_metadata and checking each
    non-tensor item before torch's planner unpickles it. Pass it to dcp.load as storage_reader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader.read_metadata (torch 2.13) does, but with the restricted unpickler:
        # dcp.load asks for `__<rank>.metadata` (rank-local metadata) when `.metadata` fails.
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = load_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        return super().read_data(plan, _CheckedBytes(planner, self))


class _CheckedBytes:
    """Stands in for the load planner while CheckedReader reads data: torch's planners unpickle a
    non-tensor item with torch.load(weights_only=False), so the item must first load with
    weights_only=True (plain values, containers and tensors only). Everything else goes to the
    planner unchanged."""

    def __init__(self, planner: LoadPlanner, reader: CheckedReader):
        self.planner, self.reader = planner, reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raw = value.getvalue()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:  # any refusal: the planner's unrestricted load must not see this item
            file = Path(self.reader.path) / self.reader.storage_data[read_item.storage_index].relative_path
            raise UnsafeCheckpointError(
                f"{file}: refusing to load checkpoint item '{read_item.storage_index.fqn}'{_unsafe_globals(raw)}: "
                "a DCP checkpoint's non-tensor items hold plain values only; this file was crafted or is not a "
                f"DCP checkpoint ({type(e).__name__})") from None
        self.planner.load_bytes(read_item, io.BytesIO(raw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)


def _unsafe_globals(raw: bytes) -> str:
    """' (it names ...)' with the globals torch's weights_only load refuses, when it can list them."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
    except Exception:  # not a torch.save file at all: the caller's message says enough
        return ""
    return f" (it names {', '.join(repr(n) for n in names)})" if names else ""
