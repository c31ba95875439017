"""A DCP checkpoint is read without running code from it (trainer/dcp_metadata.py): crafted files
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

from trainer.checkpoint import save_seed_checkpoint
from trainer.checkpoint_items import ModelState, OptimizerState, SchedulerState
from trainer.dcp_files import incomplete_reason, read_model_state, saved_keys
from trainer.dcp_metadata import CheckedReader, UnsafeCheckpointError
from trainer.train_state import TrainState


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
    from trainer.dcp_metadata import load_metadata

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
