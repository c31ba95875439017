"""Hugging Face weights in a training run: what the checkpoint manager calls to load a
Hugging Face folder at start (checkpoint.initial_load_in_hf) and to export the last save
(checkpoint.last_save_in_hf). The manager only knows the `load` / `export` interface."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer.checkpoint.on_disk import HF_EXPORT_DIR
from trainer.hf.export import export_hf_folder
from trainer.hf.folder import read_hf_folder
from trainer.models.llama3.args import LlamaModelArgs
from trainer.models.llama3.initialization import copy_global_into

logger = logging.getLogger(__name__)


class HFWeights:
    """The configured model's weights in Hugging Face form."""

    folder_name = HF_EXPORT_DIR  # the export's folder inside the checkpoint

    def __init__(self, model: torch.nn.Module, args: LlamaModelArgs):
        self.model, self.args = model, args

    @torch.no_grad()
    def load(self, path: Path) -> None:
        """Every rank reads the full tensors and keeps its shards. Raises ValueError naming the folder."""
        state = read_hf_folder(path, self.args)
        for name, param in self.model.named_parameters():
            copy_global_into(param, state[name].to(param.device, param.dtype))
        logger.info("loaded model weights from the Hugging Face folder %s", path)

    def export(self, checkpoint: Path, out: Path, dtype: torch.dtype) -> None:
        """Convert the model of a written checkpoint (one process), one tensor at a time, in
        shards of transformers' default size. Reading the checkpoint, not the ranks' memory, gets
        every stage of a pipeline-parallel run."""
        export_hf_folder(checkpoint, out, self.args, dtype)
