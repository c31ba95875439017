"""Host memory of the one-process jobs of a large model: the seed checkpoint and the Hugging Face
export. The seed job builds the whole model in float32 in one process (trainer.train.
create_seed_checkpoint); its peak is measured here by running the same construction and
initialization on fake tensors."""

from __future__ import annotations

import torch

from trainer.estimate.fake_world import fake_tensors
from trainer.estimate.step_memory import StepMemory
from trainer.models.llama3 import Transformer
from trainer.models.llama3.hf_config import configured_model_args


def seed_peak_bytes(config) -> int:
    """Peak bytes of `--checkpoint.create_seed_checkpoint` before saving: the float32 model plus
    the initialization's transient full tensors (DCP then writes from those tensors)."""
    args = configured_model_args(config.model)
    args.max_seq_len = config.training.seq_len
    with torch.device("meta"):
        model = Transformer(args)
    with fake_tensors(), StepMemory() as memory:
        model.to_empty(device="cpu")
        model.init_weights(seed=config.debug.seed, device="cpu")
    return memory.peak().total


def export_peak_bytes(config, dtype: torch.dtype, shard_bytes: int) -> tuple[int, int]:
    """(streaming, whole-model) peak bytes of the Hugging Face export of this model."""
    from trainer.hf.export import export_host_peak_bytes, whole_model_export_peak_bytes

    args = configured_model_args(config.model)
    return export_host_peak_bytes(args, dtype, shard_bytes), whole_model_export_peak_bytes(args, dtype)
