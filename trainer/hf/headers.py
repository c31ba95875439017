"""What a Hugging Face folder says about its weights, checked before any tensor is read: which
files its model.safetensors.index.json names (each a file name inside the folder), and what each
safetensors header holds (the header inside the file, every tensor's bytes inside the file and
of the size its dtype and shape take). The folder may come from anywhere: every problem is one
HFCheckpointError naming the file, and the index entry or tensor.

A safetensors file: 8 bytes, the little-endian length N of a JSON header; N bytes of header,
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}; then the data,
the offsets counted from its start.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from trainer.hf.config_json import QUOTE, inside
from trainer.hf.weights import HFCheckpointError
from trainer.models.llama3.hf_config import HFConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_LIMIT = 100 << 20  # safetensors' own limit on the size of a header
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATING = ("F16", "BF16", "F32", "F64")  # what a model's weights may be stored as (cast on loading)


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]


def _member(folder: Path, name, where: str) -> Path:
    try:
        return inside(folder, name, where)
    except HFConfigError as e:
        raise HFCheckpointError(str(e)) from None


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON and UTF-8 errors
        raise HFCheckpointError(f"{path}: not readable JSON ({what}): {e}") from None


def shard_files(folder: Path) -> dict[str, list[str]]:
    """The folder's safetensors files (each checked to be inside it), with the tensors its index
    places in each: {model.safetensors: []} for a folder without an index."""
    if not (folder / INDEX_FILE).exists() and not (folder / INDEX_FILE).is_symlink():
        _member(folder, SINGLE_FILE, str(folder))
        if not (folder / SINGLE_FILE).is_file():
            raise HFCheckpointError(f"{folder}: missing {SINGLE_FILE} (and no {INDEX_FILE} names other files)")
        return {SINGLE_FILE: []}
    index = _member(folder, INDEX_FILE, str(folder))
    data = _read_json(index, "the index of the safetensors files")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise HFCheckpointError(f'{index}: expected a JSON object with a "weight_map" object of tensor names and '
                                "file names")
    files: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        # Each file is checked once: an 8B model's index names its 4 files 291 times.
        if not isinstance(name, str) or name not in files:
            _member(folder, name, f"{index}: weight_map entry {QUOTE.repr(tensor)}")
            if not (folder / name).is_file():
                raise HFCheckpointError(f"{folder / name} is missing (the weight_map entry of {QUOTE.repr(tensor)} in "
                                        f"{index} names it)")
        files.setdefault(name, []).append(tensor)
    return dict(sorted(files.items()))


def tensor_name(name: str) -> str:
    """A tensor's name as a message writes it: as it is, unless a file made it long or gave it
    control characters (then quoted and cut short, so the message stays one line)."""
    return name if name.isprintable() and len(name) <= 160 else QUOTE.repr(name)


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """The tensors a safetensors file holds, each checked to lie inside the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
            if length is not None and length <= min(size - 8, HEADER_LIMIT):
                raw = f.read(length)
    except OSError as e:
        raise HFCheckpointError(f"{path}: cannot be read: {e.strerror}") from None
    if length is None:
        raise HFCheckpointError(f"{path}: not a safetensors file: {size} bytes, fewer than the 8 of its header length")
    if length > size - 8:
        raise HFCheckpointError(f"{path}: not a safetensors file: its header length {length} is past the end of the "
                                f"file ({size} bytes)")
    if length > HEADER_LIMIT:
        raise HFCheckpointError(f"{path}: not a safetensors file: a header of {length} bytes (at most {HEADER_LIMIT})")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise HFCheckpointError(f"{path}: not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path}: not a safetensors file: its header is not a JSON object")
    data_bytes = size - 8 - length
    return {name: _entry(path, name, entry, data_bytes) for name, entry in header.items() if name != "__metadata__"}


def _entry(path: Path, name: str, entry, data_bytes: int) -> HeaderEntry:
    where = f"{path}: tensor {tensor_name(name)}"
    if not isinstance(entry, dict):
        raise HFCheckpointError(f"{where}: its header entry {QUOTE.repr(entry)} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEM_BYTES:
        raise HFCheckpointError(f"{where}: unknown dtype {QUOTE.repr(dtype)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise HFCheckpointError(f"{where}: shape {QUOTE.repr(shape)} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise HFCheckpointError(f"{where}: data_offsets {QUOTE.repr(offsets)} are not [begin, end] byte offsets")
    if offsets[1] > data_bytes:
        raise HFCheckpointError(f"{where}: its data ends at byte {offsets[1]}, past the end of the file (which "
                                f"holds {data_bytes} bytes of data): the file is cut short or damaged")
    needed = math.prod(shape) * ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != needed:
        raise HFCheckpointError(f"{where}: holds {offsets[1] - offsets[0]} bytes, but {dtype} {shape} takes {needed}")
    return HeaderEntry(dtype, tuple(shape))


def check_entry(path: Path, name: str, entry: HeaderEntry, shape: tuple[int, ...]) -> None:
    """A tensor the model loads: a floating-point type (cast on loading), the shape config.json's model has."""
    if entry.dtype not in FLOATING:
        raise HFCheckpointError(f"{path}: tensor {tensor_name(name)} has dtype {entry.dtype}; expected a floating-point "
                                f"type ({', '.join(FLOATING)})")
    if entry.shape != tuple(shape):
        raise HFCheckpointError(f"{path}: tensor {tensor_name(name)} has shape {list(entry.shape)}, but config.json's "
                                f"model needs {list(shape)}")
