"""Unpickling a DCP checkpoint's `.metadata` without running code from it or changing the process.

torch reads `.metadata` with pickle.load, which calls whatever the file names (os.system) and
lets it change any object it can reach (BUILD on a class: `PosixPath.rename = PosixPath`), and
checkpoints are passed between people (seed checkpoints, step folders to start from).
metadata_from_bytes admits only the globals DCP writes there and only changes to objects the
file itself created (_MetadataUnpickler), then checks that the entries name data files of the
checkpoint's own folder. The error classes of every refusal to read a checkpoint are here.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
import pickle
import types
from typing import Any

import torch
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


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to load something a DCP checkpoint never holds; the message names
    the file."""


class CorruptCheckpointError(UnsafeCheckpointError):
    """A checkpoint file is not what was saved: changed, truncated, or not readable as its kind
    (it may have been crafted: the same refusal). The message names the file and what is wrong."""


def _admitted_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every global a DCP `.metadata` of torch 2.13 refers to: the
    metadata dataclasses, torch.Size (offsets and sizes), dtypes, the layout (pickled as a call
    of torch.serialization._get_layout with its name), the memory-format encoding, and the
    PosixPath the writer keeps as storage_meta.checkpoint_id. Each is harmless to call with any
    arguments: it only builds a value. (`builtins.getattr`, with which some Python releases
    pickle enum members, is admitted separately and only for those: _enum_member_getter.)"""
    admitted = {(c.__module__, c.__qualname__): c for c in _CLASSES}
    admitted[("pathlib", "PosixPath")] = pathlib.PosixPath  # its name in files of any Python version
    admitted[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    admitted |= {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return admitted


# Classes whose fresh instances a metadata file fills in with BUILD: pickle makes each with
# cls.__new__ and then sets its fields.
_BUILT = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
          MetadataIndex, StorageMeta, _StorageInfo)
_CLASSES = (*_BUILT, _MEM_FORMAT_ENCODING, torch.Size, pathlib.PosixPath)
_ADMITTED = _admitted_globals()
# What a file may call (REDUCE, NEWOBJ): the classes and _get_layout; not the dtypes.
_CALLABLE = (*_CLASSES, torch.serialization._get_layout)
# Enum classes whose members a metadata file may name. Some Python releases (3.11.2, for one)
# pickle an enum member as the call getattr(EnumClass, "NAME") rather than by value.
_ADMITTED_ENUMS = (_MEM_FORMAT_ENCODING,)
# By identity: a file's objects are compared with `is`, never with their own __eq__.
_CLASS_IDS, _ENUM_IDS = ({id(c) for c in group} for group in (_CLASSES, _ADMITTED_ENUMS))


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


def _name(obj: Any) -> str:
    """How a refusal names an object of the file: `the class PosixPath`, `a dtype`."""
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    if isinstance(obj, types.FunctionType):
        return f"the function {obj.__qualname__}"
    return f"a {type(obj).__qualname__}"


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata and nothing else.

    Every global a file names goes through find_class, which returns only _ADMITTED. That alone
    does not stop a file from changing those objects: BUILD sets attributes on whatever is on the
    stack (a class: `PosixPath.rename = PosixPath`), SETITEMS and APPENDS call the target's
    __setitem__ and extend. So each opcode that changes an existing object is checked before it
    runs: its target must be an object this very load created (a dict, list or set, or an
    instance of one of _BUILT), never a global, which is how a crafted file changes nothing in the
    process. Calls (REDUCE, NEWOBJ) may only call _CALLABLE; opcodes DCP metadata never holds
    (INST, OBJ, extension codes, persistent ids, out-of-band buffers) are refused.

    This is pickle's pure-Python unpickler with these opcodes replaced: torch's C unpickler
    offers no hook before BUILD or SETITEMS, and a pre-scan of the opcodes would have to
    reproduce pickle's stack to know each target, a second unpickler that could disagree with
    the first. It reads a 1.2 MB `.metadata` (Llama 3 8B, model and optimizer, 8 ranks) in about
    0.2 s (docs/checkpoints.md, loading checkpoints from others).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, name: str):
        self.data = io.BytesIO(data)
        super().__init__(self.data)
        self.name = name
        self.getattr = _enum_member_getter(name)
        self.callable = {id(c) for c in _CALLABLE} | {id(self.getattr)}
        # ids of the objects this load created and may fill; `kept` holds them so that no other
        # object can take an id while it is in the set.
        self.fresh: set[int] = set()
        self.kept: list = []

    def load(self) -> Any:
        # pickle's own loop, reading straight from the bytes rather than through pickle's frame
        # reader, which took a third of the time: frames only group opcodes for reading ahead,
        # and the file is already in memory (load_frame skips the frame's length).
        self.read, self.readinto, self.readline = self.data.read, self.data.readinto, self.data.readline
        self.metastack, self.stack, self.proto = [], [], 0
        self.append = self.stack.append
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                code = read(1)
                if not code:
                    raise EOFError("the data ends before pickle's STOP")
                dispatch[code[0]](self)
        except _Stop as stop:
            return stop.value

    def load_frame(self):
        self.read(8)

    def load_stop(self):
        raise _Stop(self.stack.pop())

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self.getattr
        found = _ADMITTED.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.name}: refusing to load '{module}.{name}': a DCP metadata file holds only checkpoint "
                "metadata; this file was crafted or is not a DCP checkpoint")
        return found

    def refuse(self, what: str) -> None:
        raise UnsafeCheckpointError(
            f"{self.name}: refusing to {what}: a DCP metadata file only builds new values; this file was crafted "
            "or is not a DCP checkpoint")

    def created(self, obj: Any) -> Any:
        self.fresh.add(id(obj))
        self.kept.append(obj)
        return obj

    def target(self, kinds: tuple[type, ...], opcode: str, allowed: str) -> Any:
        """The object on top of the stack, which `opcode` is about to change: refused unless this
        load created it and it is one of `kinds` (`allowed` says which in words)."""
        obj = self.stack[-1]
        if id(obj) not in self.fresh:
            self.refuse(f"apply {opcode} to {_name(obj)}, which this file did not create")
        if type(obj) not in kinds:
            self.refuse(f"apply {opcode} to {_name(obj)} (only to {allowed})")
        return obj

    # Containers this load creates, and may then fill.
    def load_empty_dictionary(self):
        self.append(self.created({}))

    def load_dict(self):
        items = self.pop_mark()
        if len(items) % 2:
            self.refuse("build a dict from an odd number of values")
        self.append(self.created({items[i]: items[i + 1] for i in range(0, len(items), 2)}))

    def load_empty_list(self):
        self.append(self.created([]))

    def load_list(self):
        self.append(self.created(self.pop_mark()))

    def load_empty_set(self):
        self.append(self.created(set()))

    # Opcodes that change an existing object.
    def load_setitem(self):
        value, key = self.stack.pop(), self.stack.pop()
        self.target((dict,), "SETITEM", "a new dict")[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        if len(items) % 2:
            self.refuse("apply SETITEMS to an odd number of values")
        self.target((dict,), "SETITEMS", "a new dict").update(zip(items[::2], items[1::2]))

    def load_append(self):
        value = self.stack.pop()
        self.target((list,), "APPEND", "a new list").append(value)

    def load_appends(self):
        items = self.pop_mark()
        self.target((list,), "APPENDS", "a new list").extend(items)

    def load_additems(self):
        items = self.pop_mark()
        self.target((set,), "ADDITEMS", "a new set").update(items)

    def load_build(self):
        state = self.stack.pop()
        instance = self.target(_BUILT, "BUILD", "new DCP metadata objects")
        setstate = getattr(type(instance), "__setstate__", None)
        if setstate is not None:  # TensorProperties: its own method, on its own new instance
            setstate(instance, state)
            return
        fields, slots = state if type(state) is tuple and len(state) == 2 else (state, None)
        for part in (fields, slots):
            if part is not None and (type(part) is not dict or not all(
                    type(k) is str and not k.startswith("__") for k in part)):
                self.refuse(f"apply BUILD to {_name(instance)} with a state that is not a table of its fields")
        instance.__dict__.update(fields or {})
        for key, value in (slots or {}).items():
            setattr(instance, key, value)

    # Calls.
    def check_callable(self, func: Any, opcode: str) -> None:
        if id(func) not in self.callable:
            self.refuse(f"call {_name(func)} ({opcode})")

    def made(self, cls: Any, obj: Any) -> Any:
        """`obj`, made by calling `cls`: new unless `cls` returns existing objects (an enum's
        members, _get_layout's layouts)."""
        new = isinstance(cls, type) and type(obj) is cls and id(cls) not in _ENUM_IDS
        return self.created(obj) if new else obj

    def load_reduce(self):
        args, func = self.stack.pop(), self.stack[-1]
        self.check_callable(func, "REDUCE")
        if type(args) is not tuple:
            self.refuse(f"call {_name(func)} with arguments that are not a tuple")
        if id(func) in _ENUM_IDS and len(args) != 1:  # a member by value; not Enum's functional API
            self.refuse(f"call {_name(func)} with {len(args)} arguments (an enum takes one)")
        self.stack[-1] = self.made(func, func(*args))

    def load_newobj(self):
        args, cls = self.stack.pop(), self.stack.pop()
        self.new_object(cls, args, {}, "NEWOBJ")

    def load_newobj_ex(self):
        kwargs, args, cls = self.stack.pop(), self.stack.pop(), self.stack.pop()
        self.new_object(cls, args, kwargs, "NEWOBJ_EX")

    def new_object(self, cls: Any, args: Any, kwargs: Any, opcode: str) -> None:
        if id(cls) not in _CLASS_IDS:
            self.refuse(f"create an instance of {_name(cls)} ({opcode})")
        if type(args) is not tuple or type(kwargs) is not dict:
            self.refuse(f"create an instance of {_name(cls)} from arguments that are not a tuple and a dict")
        self.append(self.made(cls, cls.__new__(cls, *args, **kwargs)))

    def refuse_opcode(self):
        self.refuse("run an opcode DCP metadata never holds")

    def persistent_load(self, pid):
        self.refuse("load a persistent id")

    for _code, _handler in {
            pickle.EMPTY_DICT: load_empty_dictionary, pickle.DICT: load_dict, pickle.EMPTY_LIST: load_empty_list,
            pickle.LIST: load_list, pickle.EMPTY_SET: load_empty_set, pickle.SETITEM: load_setitem,
            pickle.SETITEMS: load_setitems, pickle.APPEND: load_append, pickle.APPENDS: load_appends,
            pickle.ADDITEMS: load_additems, pickle.BUILD: load_build, pickle.REDUCE: load_reduce,
            pickle.NEWOBJ: load_newobj, pickle.NEWOBJ_EX: load_newobj_ex, pickle.FRAME: load_frame,
            pickle.STOP: load_stop, pickle.INST: refuse_opcode,
            pickle.OBJ: refuse_opcode, pickle.EXT1: refuse_opcode, pickle.EXT2: refuse_opcode,
            pickle.EXT4: refuse_opcode, pickle.NEXT_BUFFER: refuse_opcode,
            pickle.READONLY_BUFFER: refuse_opcode}.items():
        dispatch[_code[0]] = _handler
    del _code, _handler


class _Stop(Exception):
    def __init__(self, value: Any):
        super().__init__()
        self.value = value


def metadata_from_bytes(data: bytes, name: str) -> Metadata:
    """The Metadata pickled in `data` (the file `name`), read without running code from it.

    A resume reads the same `.metadata` several times (the saved keys, the shapes, DCP's load), and
    the checked unpickling takes 10 to 15 times as long as pickle's C unpickler. So once a file's
    bytes were read here, the Metadata they held is pickled again, by this process, and the next
    read of the same bytes (by sha256) unpickles that with the C unpickler: the objects are the
    ones this unpickler admitted, so the pickle is DCP's own kind, naming only admitted globals
    (_TrustedUnpickler still refuses any other), and every BUILD in it fills a new object."""
    key = hashlib.sha256(data).digest()
    if key in _READ_BEFORE:
        return _TrustedUnpickler(io.BytesIO(_READ_BEFORE[key])).load()
    metadata = _checked_metadata(data, name)
    try:
        _READ_BEFORE[key] = pickle.dumps(metadata)
    except Exception:  # an admitted value that cannot be pickled again (TensorProperties' checks): no copy
        return metadata
    while len(_READ_BEFORE) > 4:
        del _READ_BEFORE[next(iter(_READ_BEFORE))]
    return metadata


# sha256 of a .metadata read -> this process's pickle of the Metadata it held (newest last).
_READ_BEFORE: dict[bytes, bytes] = {}


class _TrustedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ADMITTED.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(f"refusing to load '{module}.{name}' from metadata read before")
        return found


def _checked_metadata(data: bytes, name: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(data, name).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or garbled: pickle, or an admitted class given bad values
        raise CorruptCheckpointError(
            f"{name}: cannot be read as DCP checkpoint metadata ({type(e).__name__}: {e}); the file is corrupted "
            "or is not a DCP checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{name}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    _check_storage(metadata, name)
    return metadata


def _check_storage(metadata: Metadata, name: str) -> None:
    """Refuse metadata whose entries are not what DCP's reader expects, above all a data file
    outside the checkpoint's folder (`../../etc/shadow`, `/dev/stdin`)."""
    entries = metadata.state_dict_metadata
    if type(entries) is not dict or not all(
            type(k) is str and type(v) in (TensorStorageMetadata, BytesStorageMetadata) for k, v in entries.items()):
        raise CorruptCheckpointError(f"{name}: its state_dict_metadata is not a table of tensors and values")
    storage = metadata.storage_data
    if storage is not None and type(storage) is not dict:
        raise CorruptCheckpointError(f"{name}: its storage_data is a {type(storage).__name__}, not a table")
    for index, info in (storage or {}).items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or not _plain_file_name(
                info.relative_path) or not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            raise CorruptCheckpointError(
                f"{name}: the entry {getattr(index, 'fqn', index)!r} names no data file of this folder "
                f"({getattr(info, 'relative_path', info)!r})")


def _plain_file_name(name: Any) -> bool:
    return type(name) is str and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
