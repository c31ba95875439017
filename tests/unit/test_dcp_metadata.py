"""A DCP checkpoint is read without running code from it (trainer/checkpoint/checked_reader.py): crafted files
are refused before anything they name is called, and the checkpoints this trainer writes load
as they did with torch's own reader."""

from __future__ import annotations

import enum
import io
import os
import pathlib
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.fsdp import fully_shard

from trainer.checkpoint.manager import save_seed_checkpoint
from trainer.checkpoint.items import ModelState, OptimizerState, SchedulerState
from trainer.checkpoint.dcp_read import incomplete_reason, read_model_state, saved_keys
from trainer.checkpoint.checked_reader import CheckedReader, UnsafeCheckpointError
from trainer.checkpoint.items import TrainState


class RunsCommand:
    """Unpickles as a call of os.system: what a crafted checkpoint file would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted_folder(tmp_path):
    """A step folder whose .metadata, when unpickled, creates the returned marker file."""
    folder, marker = tmp_path / "step-10", tmp_path / "marker"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    return folder, marker


def test_crafted_metadata_is_refused_without_running_it(tmp_path):
    folder, marker = crafted_folder(tmp_path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        CheckedReader(folder).read_metadata()
    assert str(refused.value).startswith(f"{folder / '.metadata'}: refusing to load 'posix.system'")
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        saved_keys(folder)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        read_model_state(folder)
    assert "refusing to load 'posix.system'" in incomplete_reason(folder)
    assert not marker.exists()


def test_torch_plain_reader_runs_the_crafted_metadata(tmp_path):
    """Why CheckedReader exists: torch's reader unpickles .metadata unrestricted."""
    folder, marker = crafted_folder(tmp_path)
    with pytest.raises(AttributeError):  # os.system's exit status is no Metadata
        FileSystemReader(str(folder)).read_metadata()
    assert marker.exists()


def test_metadata_of_another_type_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: holds a dict, not DCP checkpoint metadata"):
        CheckedReader(tmp_path).read_metadata()


class NamedMember:
    """Unpickles as getattr(owner, name)."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


class EnumsByName(pickle.Pickler):
    """Pickles enum members as getattr(EnumClass, "NAME"), as Python 3.11.2 does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_enum_members_pickled_by_name_load_and_other_getattrs_are_refused(tmp_path):
    """Real metadata whose memory-format enum is pickled as Python 3.11.2 does reads back; a
    getattr of anything else (here a method of an admitted class, which a later call in the
    file could run to write a file) is refused."""
    from trainer.checkpoint.checked_reader import load_metadata

    properties = TensorProperties(dtype=torch.float32)
    metadata = Metadata(state_dict_metadata={"x": TensorStorageMetadata(properties, torch.Size([2]), [])})
    buffer = io.BytesIO()
    EnumsByName(buffer).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    loaded = load_metadata(tmp_path / ".metadata")
    assert loaded.state_dict_metadata["x"].properties == properties
    (tmp_path / ".metadata").write_bytes(pickle.dumps(NamedMember(pathlib.PosixPath, "write_text")))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load 'builtins.getattr' of PosixPath.write_text"):
        load_metadata(tmp_path / ".metadata")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """One gloo process: FSDP shards every parameter as a DTensor, as in a training run."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def training_state(seed: int) -> tuple[dict, torch.nn.Module]:
    """The items of a full checkpoint, as the checkpoint manager saves them, of an FSDP model
    trained one step."""
    model = small_model(seed)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
             "lr_scheduler": SchedulerState(scheduler), "train_state": TrainState(step=seed, tokens_seen=64 * seed),
             "dataloader": {"rows_consumed": 12 * seed, "epoch": 0, "global_batch_size": 4,
                            "fingerprint": '{"data": "tiny"}'}}
    return state, model


@pytest.fixture(scope="module")
def checkpoints(process_group, tmp_path_factory):
    """kind -> a checkpoint folder written by DCP as this trainer writes it."""
    root = tmp_path_factory.mktemp("checkpoints")
    state, model = training_state(seed=3)
    dcp.save(state, checkpoint_id=str(root / "full"))
    dcp.save({"model": ModelState(model, dtype=torch.bfloat16)}, checkpoint_id=str(root / "model_only"))
    dcp.save({"model": ModelState(small_model(seed=5))}, checkpoint_id=str(root / "plain"))
    save_seed_checkpoint(small_model(seed=7), root / "seed", overwrite=False)
    return {"full": root / "full", "model_only": root / "model_only", "plain": root / "plain",
            "seed": root / "seed" / "step-0"}


@pytest.mark.parametrize("kind", ["full", "model_only", "plain", "seed"])
def test_real_metadata_reads_as_with_torch(checkpoints, kind):
    reader = CheckedReader(checkpoints[kind])
    checked, plain = reader.read_metadata(), FileSystemReader(str(checkpoints[kind])).read_metadata()
    assert checked.state_dict_metadata == plain.state_dict_metadata
    assert checked.storage_data == plain.storage_data
    assert checked.planner_data == plain.planner_data
    assert checked.storage_meta.load_id == reader.load_id  # as torch's reader: its load, not the saver's
    if kind == "full":
        assert {key.split(".")[0] for key in checked.state_dict_metadata} == {
            "model", "optimizer", "lr_scheduler", "train_state", "dataloader"}


def test_dcp_load_with_the_checked_reader_restores_a_full_checkpoint(checkpoints):
    saved, saved_model = training_state(seed=3)
    state, model = training_state(seed=11)
    dcp.load(state, storage_reader=CheckedReader(checkpoints["full"]))
    for (name, expected), actual in zip(saved_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(actual.full_tensor(), expected.full_tensor()), name
    assert (state["train_state"].step, state["train_state"].tokens_seen) == (3, 192)
    assert state["dataloader"]["rows_consumed"] == 36


def test_read_model_state_reads_a_seed_checkpoint(checkpoints):
    weights = read_model_state(checkpoints["seed"])
    for name, tensor in small_model(seed=7).state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_dcp_load_with_the_checked_reader_restores_plain_tensors(tmp_path):
    saved = small_model(seed=5)
    with warnings.catch_warnings():  # DCP notes that it runs without a process group: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
        fresh = small_model(seed=6)
        state = fresh.state_dict()
        dcp.load(state, storage_reader=CheckedReader(tmp_path), no_dist=True)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_a_crafted_non_tensor_item_is_refused_without_running_it(tmp_path):
    """torch's planner unpickles non-tensor items with weights_only=False: the reader checks them
    first. Here .metadata is genuine; the item in the data file is not."""
    marker = tmp_path / "marker"
    folder = tmp_path / "step-10"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"train_state": {"step": RunsCommand(f"touch {marker}")}}, checkpoint_id=str(folder), no_dist=True)
        refusal = re.escape(f"{folder / '__0_0.distcp'}: refusing to load checkpoint item 'train_state.step'")
        with pytest.raises(CheckpointException, match=f"{refusal}.*posix.system"):  # DCP wraps it, on every rank
            dcp.load({"train_state": {"step": 0}}, storage_reader=CheckedReader(folder), no_dist=True)
        assert not marker.exists()
        dcp.load({"train_state": {"step": 0}}, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    assert marker.exists()  # torch's own reader runs it


# Crafted metadata that changes the process through BUILD, SETITEMS, APPENDS and the like: each
# is refused before its opcode runs, and every admitted class and function is unchanged after.

def admitted_objects() -> list:
    """The classes (with their bases) and functions a metadata file may name, and the members
    of the admitted enums: what a crafted file would try to change."""
    from trainer.checkpoint.safe_unpickle import _ADMITTED, _ADMITTED_ENUMS

    found = {}
    for value in _ADMITTED.values():
        for obj in (value.__mro__ if isinstance(value, type) else (value,)):
            found[id(obj)] = obj
    for enum_class in _ADMITTED_ENUMS:
        found |= {id(member): member for member in enum_class}
    return list(found.values())


def snapshot() -> dict:
    """id -> (object, its attributes): each class's and member's __dict__ items, each function's
    __code__, __defaults__, __kwdefaults__ and __dict__ (with the items of dicts held there, such
    as _get_layout's cache)."""
    state = {}
    for obj in admitted_objects():
        attributes = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        if callable(obj) and not isinstance(obj, type):
            attributes |= {"__code__": obj.__code__, "__defaults__": obj.__defaults__,
                           "__kwdefaults__": obj.__kwdefaults__}
        attributes = {k: (v, dict(v) if type(v) is dict else None) for k, v in attributes.items()}
        state[id(obj)] = (obj, attributes)
    return state


def changes(before: dict) -> list[str]:
    after = snapshot()
    found = []
    for key, (obj, attributes) in before.items():
        now = after[key][1]
        for name in attributes.keys() | now.keys():
            old, new = attributes.get(name), now.get(name)
            if old is None or new is None or old[0] is not new[0] or old[1] != new[1]:
                found.append(f"{getattr(obj, '__qualname__', obj)}.{name}")
    return found


def restore(before: dict) -> None:
    """Undo what a crafted file changed (so that a failing test leaves the process usable)."""
    for obj, attributes in before.values():
        current = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for name in current.keys() - attributes.keys():
            delattr(obj, name) if isinstance(obj, type) else vars(obj).pop(name)
        for name, (value, items) in attributes.items():
            if items is not None:
                value.clear()
                value.update(items)
            if name in ("__code__", "__defaults__", "__kwdefaults__") or current.get(name) is not value:
                type.__setattr__(obj, name, value) if isinstance(obj, type) else object.__setattr__(obj, name, value)


@pytest.fixture
def guarded():
    """Fails the test when the process's admitted classes or functions changed, and undoes it."""
    before = snapshot()
    yield
    changed = changes(before)
    restore(before)
    assert not changed, f"the crafted file changed {changed}"


class Ops:
    """Pickle opcodes, to write crafted files by hand (protocol 2 and later opcodes mixed freely,
    as an unpickler accepts them)."""

    @staticmethod
    def glob(obj) -> bytes:
        return b"c" + f"{obj.__module__}\n{obj.__qualname__}\n".encode() if not isinstance(obj, tuple) else \
            b"c" + f"{obj[0]}\n{obj[1]}\n".encode()

    @staticmethod
    def text(value: str) -> bytes:
        return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()

    @staticmethod
    def int1(value: int) -> bytes:
        return b"K" + bytes([value])

    NONE, EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, EMPTY_SET = b"N", b"}", b"]", b")", b"\x8f"
    MARK, POP, SETITEM, SETITEMS, APPEND, APPENDS, ADDITEMS = b"(", b"0", b"s", b"u", b"a", b"e", b"\x90"
    TUPLE1, TUPLE2, BUILD, REDUCE, NEWOBJ, OBJ, BINPERSID = b"\x85", b"\x86", b"b", b"R", b"\x81", b"o", b"Q"


def genuine_metadata() -> bytes:
    properties = TensorProperties(dtype=torch.float32)
    metadata = Metadata(state_dict_metadata={"x": TensorStorageMetadata(properties, torch.Size([2]), [])},
                        storage_data={})
    return pickle.dumps(metadata, protocol=4)


def rename_attack() -> bytes:
    """The BUILD attack: PosixPath.rename becomes PosixPath (a save then never publishes)."""
    o = Ops
    return (o.glob(pathlib.PosixPath) + o.NONE + o.EMPTY_DICT + o.text("rename") + o.glob(pathlib.PosixPath)
            + o.SETITEM + o.TUPLE2 + o.BUILD + o.POP)


def build(target: bytes, field: str = "marker", value: bytes = Ops.int1(1), slots: bool = True) -> bytes:
    """`target` (opcodes that push an object), then BUILD with {field: value} as its state (as
    slot state: setattr, or as the instance dict)."""
    o = Ops
    state = o.EMPTY_DICT + o.text(field) + value + o.SETITEM
    return target + ((o.NONE + state + o.TUPLE2) if slots else state) + o.BUILD + o.POP


def member(enum_class, value) -> bytes:
    return Ops.glob(enum_class) + Ops.int1(value) + Ops.TUPLE1 + Ops.REDUCE


def _crafted_prefixes() -> dict[str, bytes]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       StorageMeta, _MEM_FORMAT_ENCODING)
    o = Ops
    classes = [Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
               MetadataIndex, StorageMeta, _StorageInfo, _MEM_FORMAT_ENCODING, torch.Size, pathlib.PosixPath]
    crafted = {"rename": rename_attack(),
               "redirect paths": build(o.glob(pathlib.PosixPath), "_str", o.text("/tmp/elsewhere")),
               "get_layout cache": build(o.glob(torch.serialization._get_layout), "cache", o.EMPTY_DICT, slots=False),
               "get_layout code": build(o.glob(torch.serialization._get_layout), "__code__",
                                        o.glob(("torch.serialization", "_get_layout"))),
               "dtype": build(o.glob(("torch", "float32")), "is_floating_point", o.NONE),
               "enum member": build(member(_MEM_FORMAT_ENCODING, 1), "_value_", o.int1(2), slots=False),
               "enum member by getattr": build(o.glob(("builtins", "getattr")) + o.glob(_MEM_FORMAT_ENCODING)
                                               + o.text("TORCH_CONTIGUOUS_FORMAT") + o.TUPLE2 + o.REDUCE, "_name_",
                                               o.text("x")),
               "class from the memo": o.glob(pathlib.PosixPath) + b"p0\n" + o.POP + o.NONE + b"g0\n"
               + build(b"", "touch", o.NONE),
               "class from the memo by BINGET": o.glob(TensorProperties) + b"q\x05" + o.POP + build(b"h\x05"),
               "setitems onto a class": o.glob(pathlib.PosixPath) + o.MARK + o.text("rename") + o.NONE + o.SETITEMS
               + o.POP,
               "setitem onto a function": o.glob(torch.serialization._get_layout) + o.text("cache") + o.NONE
               + o.SETITEM + o.POP,
               "setitems onto an enum member": member(_MEM_FORMAT_ENCODING, 1) + o.MARK + o.text("_value_")
               + o.int1(3) + o.SETITEMS + o.POP,
               "setitems onto a new instance": o.glob(TensorProperties) + o.EMPTY_TUPLE + o.NEWOBJ + o.MARK
               + o.text("dtype") + o.NONE + o.SETITEMS + o.POP,
               "append onto a class": o.glob(torch.Size) + o.int1(1) + o.APPEND + o.POP,
               "appends onto a new instance": o.glob(pathlib.PosixPath) + o.text("/x") + o.TUPLE1 + o.REDUCE + o.MARK
               + o.int1(1) + o.APPENDS + o.POP,
               "additems onto a class": o.glob(pathlib.PosixPath) + o.MARK + o.int1(1) + o.ADDITEMS + o.POP,
               "newobj of a function": o.glob(torch.serialization._get_layout) + o.EMPTY_TUPLE + o.NEWOBJ + o.POP,
               "reduce of a dtype": o.glob(("torch", "float32")) + o.EMPTY_TUPLE + o.REDUCE + o.POP,
               "enum functional API": o.glob(_MEM_FORMAT_ENCODING) + o.text("E") + o.text("A B") + o.TUPLE2
               + o.REDUCE + o.POP,
               "obj": o.MARK + o.glob(pathlib.PosixPath) + o.text("/x") + o.OBJ + o.POP,
               "inst": b"(X\x02\x00\x00\x00/xipathlib\nPosixPath\n" + o.POP,
               "extension code": b"\x82\x01" + o.POP,
               "persistent id": b"Pabc\n" + o.POP,
               "binary persistent id": o.text("abc") + o.BINPERSID + o.POP,
               "build with dunder keys on a new instance": build(o.glob(TensorStorageMetadata) + o.EMPTY_TUPLE + o.NEWOBJ,
                                                                 "__class__", o.glob(Metadata))}
    for cls in classes:
        crafted[f"build on {cls.__qualname__}"] = build(o.glob(cls))
        crafted[f"instance dict build on {cls.__qualname__}"] = build(o.glob(cls), slots=False)
    return crafted


CRAFTED = _crafted_prefixes()


@pytest.mark.parametrize("name", list(CRAFTED))
def test_metadata_that_would_change_the_process_is_refused_before_it_runs(tmp_path, guarded, name):
    """Each crafted prefix before a genuine .metadata: torch's unpickler (and this reader before it
    checked opcodes) loads the genuine metadata after running it, the class patched for good."""
    from trainer.checkpoint.checked_reader import load_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(CRAFTED[name] + genuine_metadata())
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_metadata(path)
    assert str(refused.value).startswith(f"{path}: refusing to "), str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_rename_attack_names_what_it_tried(tmp_path, guarded):
    from trainer.checkpoint.checked_reader import load_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(rename_attack() + genuine_metadata())
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_metadata(path)
    assert str(refused.value) == (f"{path}: refusing to apply BUILD to the class PosixPath, which this file did not create: a "
                                  "DCP metadata file only builds new values; this file was crafted or is not a DCP "
                                  "checkpoint")
    assert pathlib.PosixPath.rename is not pathlib.PosixPath and str(pathlib.Path("/a")) == "/a"


def test_torch_plain_reader_runs_the_build_attack(tmp_path, guarded):
    """Why the reader checks opcodes: torch's reader loads the file, and PosixPath.rename is gone."""
    folder = tmp_path / "step-1"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"x": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    raw = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(rename_attack() + raw)
    before = snapshot()
    try:
        assert isinstance(FileSystemReader(str(folder)).read_metadata(), Metadata)
        assert pathlib.PosixPath.rename is pathlib.PosixPath
    finally:
        restore(before)


def opcode_mutations(raw: bytes, count: int, seed: int) -> list[bytes]:
    """`count` variants of a pickle: an opcode replaced by another, an opcode (with a harmless
    argument) inserted, or one removed, at an opcode boundary."""
    import pickletools
    import random

    rng = random.Random(seed)
    starts = [pos for _, _, pos in pickletools.genops(raw)]
    codes = [bytes([op.code.encode("latin-1")[0]]) for op in pickletools.opcodes]
    inserts = [*codes, *(c for c in CRAFTED.values() if len(c) < 40), Ops.text("x"), Ops.int1(7), b"h\x01",
               b"j\x02\x00\x00\x00", b"q\x03", b"\x94"]
    variants = []
    for _ in range(count):
        at = rng.choice(starts)
        kind = rng.randrange(3)
        if kind == 0:
            variants.append(raw[:at] + rng.choice(codes) + raw[at + 1:])
        elif kind == 1:
            variants.append(raw[:at] + rng.choice(inserts) + raw[at:])
        else:
            nxt = min((s for s in starts if s > at), default=len(raw))
            variants.append(raw[:at] + raw[nxt:])
    return variants


def test_random_opcode_changes_to_a_genuine_file_load_or_are_refused(tmp_path, guarded):
    from trainer.checkpoint.checked_reader import load_metadata

    genuine = tmp_path / "genuine"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"x": torch.ones(2), "y": {"step": 3}}, checkpoint_id=str(genuine), no_dist=True)
    path = tmp_path / ".metadata"
    outcomes = {"loaded": 0, "refused": 0}
    for variant in opcode_mutations((genuine / ".metadata").read_bytes(), count=400, seed=0):
        path.write_bytes(variant)
        try:
            outcomes["loaded" if isinstance(load_metadata(path), Metadata) else "?"] += 1
        except UnsafeCheckpointError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["loaded"] > 0, outcomes
