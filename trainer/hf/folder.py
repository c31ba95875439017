"""A Hugging Face save_pretrained folder: config.json + model.safetensors, or shards
model-0000i-of-0000N.safetensors listed by model.safetensors.index.json."""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.hf.config_json import read_checked_config
from trainer.hf.headers import INDEX_FILE, SINGLE_FILE, check_entry, read_header, shard_files, tensor_name
from trainer.hf.weights import HFCheckpointError, from_hf, key_map, to_hf_tensor
from trainer.models.llama3.args import LlamaModelArgs
from trainer.models.llama3.hf_config import HFConfigError, check_hf_config, hf_config

# transformers' save_pretrained default, max_shard_size="5GB" (powers of 1000).
DEFAULT_SHARD_BYTES = 5 * 10**9


def read_hf_folder(path: str | Path, args: LlamaModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict (full tensors, CPU) from a save_pretrained folder whose config.json
    matches `args` (the configured model). The folder is untrusted: its config.json, index and
    safetensors headers are checked before a tensor is read (trainer.hf.headers), and only the
    tensors the model takes are read."""
    folder = Path(path)
    try:
        check_hf_config(read_checked_config(folder, "checkpoint.initial_load_path"), args, f"{folder}/config.json")
    except HFConfigError as e:
        raise HFCheckpointError(str(e)) from None
    # The folder's own structure first (index, headers): cheap, and it says what the files hold.
    headers = {}
    for name, placed in shard_files(folder).items():
        file = folder / name
        header = headers[file] = read_header(file)
        for tensor in placed:
            if tensor not in header:
                raise HFCheckpointError(f"{file}: holds no tensor {tensor_name(tensor)} (the index places it there)")
    shapes = {t.theirs: t.shape for t in hf_tensors(args)}
    shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])  # a tied model's alias, compared
    state: dict[str, torch.Tensor] = {}
    found_in: dict[str, Path] = {}
    for file, header in headers.items():
        wanted = [tensor for tensor in header if tensor in shapes]
        for tensor in wanted:
            check_entry(file, tensor, header[tensor], shapes[tensor])
            if tensor in found_in:
                raise HFCheckpointError(f"{file}: tensor {tensor_name(tensor)} is also in {found_in[tensor]}")
            found_in[tensor] = file
        state.update(_read_tensors(file, wanted))
    return from_hf(state, args, str(folder))


def _read_tensors(file: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as e:  # what the header check cannot see, e.g. bytes between tensors
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None


# ---------------------------------------------------------------------------------------------
# Writing, one shard at a time


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the export: our name (the checkpoint key is "model." + ours), the Hugging Face
    name, and the shape (the same on both sides)."""

    ours: str
    theirs: str
    shape: tuple[int, ...]

    def bytes(self, dtype: torch.dtype) -> int:
        return torch.Size(self.shape).numel() * dtype.itemsize


def hf_tensors(args: LlamaModelArgs) -> list[HFTensor]:
    """The tensors an export writes, in the model's parameter order (embedding, layers, norm,
    output: the order save_pretrained fills its shards in). Shapes from the model built on the
    meta device, so nothing is allocated; a tied output is the embedding and not listed again."""
    from trainer.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    names = key_map(args)
    return [HFTensor(ours, names[ours], tuple(p.shape)) for ours, p in model.named_parameters()]


def shard_plan(sizes: list[int], shard_bytes: int) -> list[list[int]]:
    """Positions in `sizes` grouped into shards, in order, as save_pretrained groups them: a shard
    takes tensors until the next one would pass shard_bytes; a tensor larger than that is a shard
    of its own."""
    shards: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if shards[-1] and held + size > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append(i)
        held += size
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_hf_tensors(path: str | Path, args: LlamaModelArgs, dtype: torch.dtype, shard_bytes: int,
                     read: Callable[[str], torch.Tensor]) -> Path:
    """config.json and the safetensors files of a save_pretrained folder. `read(ours)` gives one of
    our tensors (in any dtype); it is called once per tensor, in parameter order, and the tensor is
    converted and cast at once, so this holds one shard of written tensors plus the one in hand."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(args)
    plan = shard_plan([t.bytes(dtype) for t in tensors], shard_bytes)
    files = shard_file_names(len(plan))
    for file, shard in zip(files, plan):
        written = {tensors[i].theirs: _converted(tensors[i].ours, read(tensors[i].ours), args, dtype) for i in shard}
        save_file(written, str(folder / file), metadata={"format": "pt"})
        readable_as_umask_allows(folder / file)
        del written  # before the next shard is read
        _return_freed_memory()
    if len(files) > 1:
        weight_map = {tensors[i].theirs: file for file, shard in zip(files, plan) for i in shard}
        index = {"metadata": {"total_size": sum(t.bytes(dtype) for t in tensors)}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = hf_config(args, str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def readable_as_umask_allows(file: Path) -> None:
    """safetensors creates its files readable by their owner only (0600); give them the mode any
    other file of the folder gets (0644 under the usual umask 022), so others on a shared cluster
    can read the weights as they can read config.json."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def _converted(ours: str, w: torch.Tensor, args: LlamaModelArgs, dtype: torch.dtype) -> torch.Tensor:
    # Rebinding `w` drops the tensor as read once it is converted (the caller keeps no reference):
    # at most two copies of one tensor exist at a time.
    w = to_hf_tensor(ours, w.detach(), args)
    return w.to("cpu", dtype)


def _return_freed_memory() -> None:
    """Give the written shard's memory back to the system. glibc keeps freed blocks smaller than
    its mmap threshold (up to 32 MB: every tensor of a small model, wk and wv of 8B) in its heap,
    still resident, where a later large tensor cannot use them: without this the next shard's
    largest tensor is allocated beside the last shard, not in its place. Other C libraries: no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def write_hf_folder(path: str | Path, state: dict[str, torch.Tensor], args: LlamaModelArgs,
                    dtype: torch.dtype = torch.float32, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """A save_pretrained folder from our state dict in memory (extra keys such as freqs_cis and a
    tied output.weight are ignored)."""
    return write_hf_tensors(path, args, dtype, shard_bytes, state.__getitem__)
