"""A checkpoint records checksums as it is saved (trainer/checkpoint/checksums.py) and the reader
refuses what changed since (trainer/checkpoint/checked_reader.py CheckedReader): a flipped bit in a shard, a
truncated shard, a changed .metadata, each with one error naming the file (and the tensors).
Checkpoints saved by one process (seed), by two gloo ranks (FSDP) and asynchronously (AsyncSaver)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import fully_shard

from tests.ranks import start_ranks
from trainer.checkpoint.checksums import CHECKSUMS_FILE, ChecksumWriter
from trainer.checkpoint.step_folder import save_seed_checkpoint
from trainer.checkpoint.items import ModelState
from trainer.checkpoint.dcp_read import TensorReader, read_model_state, refusals_unwrapped
from trainer.checkpoint.checked_reader import CheckedReader, CorruptCheckpointError, UnsafeCheckpointError
from trainer.checkpoint.items import TrainState

CHANGED = "the file was changed or corrupted after it was saved (checkpoint.verify_checksums = false loads it anyway)"


def small_model(seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _save_on_two_ranks(rank: int, folder: str) -> None:
    """Rank `rank` of 2: FSDP shards small_model() over both ranks; saves it as checkpoint.py
    does (dcp.save with ChecksumWriter) and asynchronously (AsyncSaver, with the train state)."""
    from trainer.checkpoint.async_save import AsyncSaver
    from trainer.launch.process_exit import exit_without_teardown

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
    model = small_model()
    fully_shard(model)
    dcp.save({"model": ModelState(model)}, storage_writer=ChecksumWriter(Path(folder) / "sync"))
    saver = AsyncSaver("async", rank, publish=lambda step, partial: None)
    saver.start({"model": ModelState(model), "train_state": TrainState(step=4, tokens_seen=8)}, 4,
                Path(folder) / "async")
    saver.wait()
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """kind -> a checkpoint folder: "seed" (one process), "sync" and "async" (two ranks)."""
    root = tmp_path_factory.mktemp("saved")
    start_ranks(_save_on_two_ranks, (str(root),), 2)
    seed = save_seed_checkpoint(small_model(), root / "seeds", overwrite=False)
    return {"seed": seed, "sync": root / "sync", "async": root / "async"}


@pytest.fixture
def copy_of(saved, tmp_path):
    """A copy of a saved checkpoint, to corrupt."""
    def copy(kind: str) -> Path:
        shutil.copytree(saved[kind], tmp_path / kind)
        return tmp_path / kind
    return copy


def flip_float_bits(folder: Path, file: str, values: torch.Tensor, count: int = 1024) -> None:
    """Flips the lowest bit of `count` float32 values of `values` where `file` holds them."""
    path = folder / file
    raw = bytearray(path.read_bytes())
    at = raw.find(values.detach().contiguous().numpy().tobytes())
    assert at >= 0, "the values are not in the file"
    for i in range(count):
        raw[at + 4 * i] ^= 1
    path.write_bytes(raw)


@pytest.mark.parametrize("kind", ["seed", "sync", "async"])
@pytest.mark.cores(2)
def test_every_item_and_the_metadata_have_their_checksum(saved, kind):
    """checksums.json lists every item .metadata lists, at the same place, each data file's size and
    .metadata's checksum; DCP's own files are unchanged, so plain torch reads the checkpoint."""
    folder = saved[kind]
    recorded = json.loads((folder / CHECKSUMS_FILE).read_text())
    metadata = CheckedReader(folder).read_metadata()
    listed = {(name, item["offset"], item["length"], item["key"]) for name, entry in recorded["files"].items()
              for item in entry["items"]}
    assert listed == {(info.relative_path, info.offset, info.length, index.fqn)
                      for index, info in metadata.storage_data.items()}
    assert sorted(recorded["files"]) == (["__0_0.distcp"] if kind == "seed" else ["__0_0.distcp", "__1_0.distcp"])
    assert all(entry["size"] == (folder / name).stat().st_size for name, entry in recorded["files"].items())
    raw = (folder / ".metadata").read_bytes()
    assert recorded["metadata"] == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    state = {"model": {k: torch.zeros_like(v) for k, v in small_model().state_dict().items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in small_model().state_dict().items())


@pytest.mark.parametrize("kind, file", [("seed", "__0_0.distcp"), ("sync", "__1_0.distcp"),
                                        ("async", "__0_0.distcp")])
def test_a_flipped_bit_in_a_shard_is_refused_naming_the_file_and_tensor(copy_of, kind, file):
    """1,024 float32 values of one tensor changed by their lowest bit: every read path refuses the
    checkpoint; verify=False loads exactly those changed values."""
    folder = copy_of(kind)
    weight = small_model().state_dict()["0.weight"]
    rows = {"__0_0.distcp": weight[:32], "__1_0.distcp": weight[32:]}[file] if kind != "seed" else weight
    flip_float_bits(folder, file, rows)
    message = f"{folder / file}: checksum mismatch in tensors model.0.weight: {CHANGED}"
    with pytest.raises(CorruptCheckpointError) as refused:
        read_model_state(folder)
    assert str(refused.value) == message
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        TensorReader(folder).read("model.0.weight")
    state = {"model": {k: torch.zeros_like(v) for k, v in small_model(6).state_dict().items()}}
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)), refusals_unwrapped(), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=CheckedReader(folder), no_dist=True)
    loaded = read_model_state(folder, verify=False)
    assert (loaded["0.weight"] != weight).sum().item() == 1024
    assert torch.equal(loaded["0.bias"], small_model().state_dict()["0.bias"])


def test_a_load_that_reads_part_of_a_file_checks_what_it_reads(copy_of):
    """Rank 1's file holds a chunk of every tensor: a corrupted chunk of 0.weight refuses the reads
    of 0.weight only; the other tensors of the same file read back exactly."""
    folder = copy_of("sync")
    flip_float_bits(folder, "__1_0.distcp", small_model().state_dict()["0.weight"][32:], count=1)
    reader = TensorReader(folder)
    for key, tensor in small_model().state_dict().items():
        if key == "0.weight":
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensors model.0.weight"):
                reader.read(f"model.{key}")
        else:
            assert torch.equal(reader.read(f"model.{key}"), tensor), key


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_shard_is_refused_naming_the_file(copy_of, verify):
    """Today's torch ends in `CheckpointException ranks:dict_keys([0])`, naming no file."""
    folder = copy_of("sync")
    file = folder / "__1_0.distcp"
    size = file.stat().st_size
    os.truncate(file, size // 2)
    with pytest.raises(CorruptCheckpointError) as refused:
        read_model_state(folder, verify=verify)
    assert str(refused.value).startswith(f"{file}: truncated: it holds {size // 2} bytes, .metadata places ")
    assert f"up to byte {size}; the file was cut short after it was saved" in str(refused.value)
    assert isinstance(refused.value, UnsafeCheckpointError)


def test_a_changed_metadata_is_refused_before_it_is_unpickled(copy_of):
    folder = copy_of("seed")
    raw = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(raw.replace(b"model.0.bias", b"model.0.bIas"))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder / '.metadata'}: checksum mismatch: {CHANGED}")):
        read_model_state(folder)
    assert "model.0.bIas" in CheckedReader(folder, verify=False).read_metadata().state_dict_metadata


@pytest.mark.parametrize("content", [b"{not json", b'{"format": "dcp-checksums", "version": 1, "algorithm": "crc32"}',
                                     b'{"format": "dcp-checksums", "version": 2, "algorithm": "crc32"}'])
def test_an_unreadable_checksums_file_is_refused_naming_it(copy_of, content):
    folder = copy_of("seed")
    (folder / CHECKSUMS_FILE).write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder / CHECKSUMS_FILE}: ")):
        read_model_state(folder)
    assert torch.equal(read_model_state(folder, verify=False)["1.weight"], small_model().state_dict()["1.weight"])


def test_a_checksums_file_of_another_checkpoint_is_refused(copy_of, saved):
    folder = copy_of("sync")
    shutil.copy(saved["seed"] / CHECKSUMS_FILE, folder / CHECKSUMS_FILE)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder / '.metadata'}: checksum mismatch")):
        read_model_state(folder)


def test_a_checkpoint_without_checksums_loads(tmp_path, caplog):
    """Checkpoints saved before checksums were recorded (torch's own writer) load unchecked, with a
    debug line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": small_model().state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    assert not (tmp_path / CHECKSUMS_FILE).exists()
    with caplog.at_level(logging.DEBUG, logger="trainer.checkpoint.checked_reader"):
        loaded = read_model_state(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in small_model().state_dict().items())
    assert f"{tmp_path} has no {CHECKSUMS_FILE} (saved before checksums were recorded)" in caplog.text


def test_non_tensor_items_are_checked_too(copy_of):
    """The async save holds the train state as a non-tensor item: a changed byte in it is refused."""
    folder = copy_of("async")
    recorded = json.loads((folder / CHECKSUMS_FILE).read_text())
    item = next(i for entry in recorded["files"].values() for i in entry["items"] if i["key"] == "train_state.step")
    file = next(name for name, entry in recorded["files"].items() if item in entry["items"])
    raw = bytearray((folder / file).read_bytes())
    raw[item["offset"] + item["length"] // 2] ^= 0xFF
    (folder / file).write_bytes(raw)
    state = {"train_state": {"step": 0, "tokens_seen": 0}}
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder / file}: checksum mismatch in items "
                                                               "train_state.step")), \
            refusals_unwrapped(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=CheckedReader(folder), no_dist=True)
