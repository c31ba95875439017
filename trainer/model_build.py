"""Building this rank's part of the model: on the meta device, parallelized, then materialized.

Two steps, because the estimator (trainer.estimate) runs the second on fake tensors: the
parallelisms are applied to the model on the meta device (no memory, real device meshes), and
only materializing allocates the weights of this rank.
"""

from __future__ import annotations

import logging

import torch

from trainer.models.llama3 import Transformer
from trainer.models.llama3.hf_config import configured_model_args
from trainer.parallel import ParallelModel, parallelize
from trainer.parallel.fsdp import DTYPES, parameters_in

logger = logging.getLogger(__name__)


def training_model_args(config):
    """The configured model's shapes, with RoPE tables long enough for training and validation."""
    args = configured_model_args(config.model)
    args.max_seq_len = max(config.training.seq_len, config.validation.seq_len if config.validation.enable else 0)
    return args


def build_on_meta(config, dims, mesh, device: torch.device, model_args) -> ParallelModel:
    """The model built on the meta device with every configured parallelism applied: no full copy
    ever exists. Its parameters are of training.dtype (FSDP keeps what it is given)."""
    with torch.device("meta"), parameters_in(DTYPES[config.training.dtype]):
        model = Transformer(model_args)
    parallel = parallelize(model, dims, mesh, config, device)
    if parallel.stage_plan is not None:
        logger.info("pipeline: %s", parallel.stage_plan.describe())
    return parallel


def materialize(parallel: ParallelModel, seed: int, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and draw the initial weights (the same global
    weights whatever the layout, see Transformer.init_weights)."""
    for stage in parallel.stages.values():
        stage.to_empty(device=device)
        stage.init_weights(seed=seed, device=device)
        stage.train()
