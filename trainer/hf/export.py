"""The Hugging Face export of a DCP checkpoint, streamed: tensors are read from the checkpoint one
at a time, converted, cast, and written in shards, so the process holds one shard plus the tensor
in hand instead of the whole model. Also the export's host memory from the model's shapes alone
(for the 8B/70B/405B tables), and that of the former whole-model export for comparison.

Memory of one tensor of S bytes as saved (float32 in a training checkpoint) and O bytes as
exported: DCP loads it into the tensor allocated for it from a chunk it reads in full (the whole
tensor when one process saved it), so 2 S while reading; converting copies wq and wk once (the
RoPE row order) and casting makes an O-byte copy when the dtype changes, each from one copy of
the tensor: at most max(2 S, S + O). The cast tensor then joins the shard in hand.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from trainer.hf.folder import DEFAULT_SHARD_BYTES, HFTensor, hf_tensors, shard_plan, write_hf_tensors
from trainer.hf.weights import HFCheckpointError, permutes_rows
from trainer.models.llama3.args import LlamaModelArgs

MODEL_KEY = "model."  # the checkpoint item holding the weights (trainer.checkpoint.items.ModelState)
SAVED_DTYPE = torch.float32  # what training checkpoints hold, and the estimates assume

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a size such as 5GB (powers of 1000, as transformers' max_shard_size), 4GiB
    (powers of 1024) or 1000000 (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, TB (powers of 1000) "
                         "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def export_hf_folder(checkpoint: Path, out: Path, args: LlamaModelArgs, dtype: torch.dtype,
                     shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model of the DCP checkpoint in `checkpoint` as a save_pretrained folder `out`
    (config.json and safetensors in `dtype`, shards of at most shard_bytes), reading one tensor
    at a time. Raises HFCheckpointError naming the checkpoint when it does not hold this model."""
    from trainer.checkpoint.dcp_read import TensorReader

    reader = TensorReader(Path(checkpoint))
    _check_saved_shapes(checkpoint, reader.saved, hf_tensors(args))
    return write_hf_tensors(out, args, dtype, shard_bytes, lambda ours: reader.read(MODEL_KEY + ours))


def _check_saved_shapes(checkpoint: Path, saved: dict, tensors: list[HFTensor]) -> None:
    """Before anything is written: every tensor of the configured model is in the checkpoint with
    its shape."""
    problems = []
    for t in tensors:
        key = MODEL_KEY + t.ours
        if key not in saved:
            problems.append(f"{key} is missing")
        elif saved[key][0] != t.shape:
            problems.append(f"{key} has shape {list(saved[key][0])}, the model's is {list(t.shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise HFCheckpointError(f"{checkpoint}: does not hold the model to export: {'; '.join(problems[:3])}{more}; "
                                "was it saved with another model flavor?")


# ---------------------------------------------------------------------------------------------
# Host memory, from the shapes


def _tensor_in_hand(t: HFTensor, dtype: torch.dtype) -> int:
    """Peak bytes while one tensor is read, converted and cast (module docstring)."""
    saved = t.bytes(SAVED_DTYPE)
    cast = t.bytes(dtype) if dtype != SAVED_DTYPE else 0
    return max(2 * saved, saved + cast)


def export_host_peak_bytes(args: LlamaModelArgs, dtype: torch.dtype, shard_bytes: int) -> int:
    """Peak host bytes of the streaming export of a float32 checkpoint of this model (above the
    process's own: Python, torch, the checkpoint's .metadata): the largest, over the tensors in
    write order, of the shard written so far plus the tensor in hand. The shards are those the
    export writes (the same plan), and each tensor is taken as saved in one chunk, as one process
    saves it: exact for such a checkpoint up to the allocator's rounding, an upper bound for a
    run's checkpoint, whose tensors DCP reads in smaller chunks."""
    tensors = hf_tensors(args)
    peak = 0
    for shard in shard_plan([t.bytes(dtype) for t in tensors], shard_bytes):
        held = 0
        for i in shard:
            peak = max(peak, held + _tensor_in_hand(tensors[i], dtype))
            held += tensors[i].bytes(dtype)
    return peak


def whole_model_export_peak_bytes(args: LlamaModelArgs, dtype: torch.dtype) -> int:
    """Peak host bytes of the former export of a float32 checkpoint of this model (every tensor read
    at once, then converted and cast): while reading, the tensors filled so far plus the one being
    read, twice (DCP allocates them all first, but the system gives a tensor its pages only as it
    is filled; they are filled in the order saved, the parameter order); then the whole model plus
    the permuted copies of every wq and wk and, when the dtype changes, a cast copy of every tensor."""
    tensors = hf_tensors(args)
    reading, filled = 0, 0
    for t in tensors:
        reading = max(reading, filled + 2 * t.bytes(SAVED_DTYPE))
        filled += t.bytes(SAVED_DTYPE)
    permuted = sum(t.bytes(SAVED_DTYPE) for t in tensors if permutes_rows(t.ours, args))
    cast = sum(t.bytes(dtype) for t in tensors) if dtype != SAVED_DTYPE else 0
    return max(reading, filled + permuted + cast)
