"""Reading a DCP checkpoint folder in one process, whatever layout wrote it: the keys and shapes
it holds, and its model weights (all at once, or tensor by tensor). Used by the checkpoint
manager and by the Hugging Face converter, which must not depend on each other. Every read goes
through CheckedReader, which refuses a crafted checkpoint instead of running code from it, and a
changed or truncated one (checksums) instead of loading wrong values."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint.checked_reader import CheckedReader, UnsafeCheckpointError


def saved_keys(path: Path) -> dict[str, tuple | None]:
    """Flattened key -> saved tensor shape (None for non-tensor values)."""
    metadata = CheckedReader(path).read_metadata()
    return {key: tuple(getattr(entry, "size", ())) or None for key, entry in metadata.state_dict_metadata.items()}


def read_model_state(path: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model weights of a DCP checkpoint as plain CPU tensors, read by this process alone
    (whatever layout wrote it: every shard and pipeline stage is in the folder); `verify`: check
    them against the checkpoint's checksums."""
    # What torch's own dcp_to_torch_save does, without the detour through a file: the public
    # dcp.load only fills keys the caller already has.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # Read .metadata first: a refusal raised inside DCP's load comes back wrapped in its
    # fallback to rank-local metadata, no longer one clear error.
    reader = CheckedReader(path, verify)
    reader.read_metadata()
    state: dict = {}
    with refusals_unwrapped():
        _load_state_dict(state, storage_reader=reader,
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return state["model"]


class TensorReader:
    """Reads the tensors of a DCP checkpoint one at a time, by key, each with a partial load into
    a tensor of its saved shape and dtype: a process holds only the tensors it keeps, whatever
    the checkpoint's size or the layout that wrote it."""

    def __init__(self, path: Path, verify: bool = True):
        self.reader = _MetadataOnce(path, verify)
        # Read .metadata first, for one clear error (see read_model_state).
        metadata = self.reader.read_metadata()
        self.saved: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            key: (tuple(entry.size), entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}

    def read(self, key: str) -> torch.Tensor:
        """The full tensor saved under `key` (a flattened key, e.g. model.norm.weight), on the CPU."""
        import torch.distributed.checkpoint as dcp

        shape, dtype = self.saved[key]
        tensor = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings(), refusals_unwrapped():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # intended
            dcp.load({key: tensor}, storage_reader=self.reader, no_dist=True)
        return tensor


class _MetadataOnce(CheckedReader):
    """A CheckedReader that unpickles .metadata once for many loads: a run's .metadata lists every
    chunk that every rank wrote, and TensorReader loads key by key."""

    def __init__(self, path: Path, verify: bool = True):
        super().__init__(path, verify)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # DCP's fallback to rank-local metadata: not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


@contextmanager
def refusals_unwrapped():
    """DCP wraps what failed on each rank in a CheckpointException: raise the refusal itself
    (one clear message naming the file) when that is what failed."""
    try:
        yield
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        refusals = [f for f in failures if isinstance(f, UnsafeCheckpointError)]
        if refusals:
            raise refusals[0] from None
        raise


def saved_items(keys: dict) -> set[str]:
    return {key.split(".", 1)[0] for key in keys}


def incomplete_reason(path: Path) -> str | None:
    """Why the DCP checkpoint in `path` cannot be complete, or None: its .metadata must be
    readable, and every data file it names must hold the bytes it lists."""
    try:
        metadata = CheckedReader(path).read_metadata()
    except Exception as e:  # a truncated, foreign or crafted file (refused unread): any error means the same
        return f"its .metadata cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file() or file.stat().st_size < size:
            return f"its data file {name} is missing or shorter than .metadata says ({size} bytes)"
    return None
