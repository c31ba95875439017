"""One step's gradients as the trainer computes them, saved for a test to compare.

`python -m tests.workers.fp16_gradients OUT.pt [--unscaled] --section.key value ...`: builds the
trainer from the overrides, runs forward and backward on its first batch (with the loss scale of
a float16 run, then unscaled as the optimizer would see them; `--unscaled`: without the scale),
and saves every gradient, as float32, concatenated in parameter order."""

from __future__ import annotations

import os
import sys

import torch

from trainer.config.manager import load_config, with_default_config
from trainer.loss_scale import unscale_gradients
from trainer.preflight import plan_run
from trainer.train import Trainer


def main(out: str, unscaled: bool, overrides: list[str]) -> None:
    config = load_config(with_default_config(overrides))
    trainer = Trainer(config, plan_run(config, int(os.environ.get("WORLD_SIZE", "1"))))
    scale = None if unscaled or trainer.loss_scaler is None else trainer.loss_scaler.scale
    trainer.runner.forward_backward(trainer.loader.next_batch(), scale)
    if scale is not None:
        unscale_gradients(trainer.model.parameters(), scale)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in trainer.model.parameters()]
    torch.save(torch.cat([g.float().flatten() for g in grads]), out)
    trainer.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], "--unscaled" in args, [a for a in args[1:] if a != "--unscaled"])
