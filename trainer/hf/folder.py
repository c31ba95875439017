"""A Hugging Face save_pretrained folder: config.json + model.safetensors (single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.hf.weights import HFCheckpointError, from_hf, to_hf
from trainer.models.llama3.args import LlamaModelArgs
from trainer.models.llama3.hf_config import HFConfigError, check_hf_config, hf_config, read_config_json


def _safetensors_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def read_hf_folder(path: str | Path, args: LlamaModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict (full tensors, CPU) from a save_pretrained folder whose config.json
    matches `args` (the configured model)."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        check_hf_config(read_config_json(folder, "checkpoint.initial_load_path"), args, f"{folder}/config.json")
    except HFConfigError as e:
        raise HFCheckpointError(str(e)) from None
    state = {}
    for name in _safetensors_files(folder):
        if not (folder / name).is_file():
            raise HFCheckpointError(f"{folder}: missing {name}")
        state.update(load_file(str(folder / name)))
    return from_hf(state, args, str(folder))


def write_hf_folder(path: str | Path, state: dict[str, torch.Tensor], args: LlamaModelArgs,
                    dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors, as `save_pretrained` writes them."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf(state, args).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(args, str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
