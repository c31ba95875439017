"""One step's gradients as the trainer computes them, saved for a test to compare.

`python -m tests.workers.fp16_gradients OUT.pt [--unscaled] --section.key value ...`: builds the
trainer from the overrides, runs forward and backward on its first batch (with the loss scale of
a float16 run, then unscaled as the optimizer would see them; `--unscaled`: without the scale),
and saves every gradient, as float32, concatenated in parameter order.

`python -m tests.workers.fp16_gradients --runs RUNS.json`, RUNS a list of {"out": ..., "unscaled":
bool, "overrides": [...]}: the same for each, one after the other in this one process (torch
started once), each with a trainer of its own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from trainer.config.manager import load_config, with_default_config
from trainer.loss_scale import unscale_gradients
from trainer.preflight.checks import plan_run
from trainer.train import Trainer


def main(out: str, unscaled: bool, overrides: list[str], end_process_group: bool = True) -> None:
    config = load_config(with_default_config(overrides))
    trainer = Trainer(config, plan_run(config, int(os.environ.get("WORLD_SIZE", "1"))))
    scale = None if unscaled or trainer.loss_scaler is None else trainer.loss_scaler.scale
    trainer.runner.forward_backward(trainer.loader.next_batch(), scale)
    if scale is not None:
        unscale_gradients(trainer.model.parameters(), scale)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in trainer.model.parameters()]
    torch.save(torch.cat([g.float().flatten() for g in grads]), out)
    trainer.close(end_process_group=end_process_group)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--runs"]:
        runs = json.loads(Path(args[1]).read_text())
        for index, run in enumerate(runs):
            main(run["out"], run["unscaled"], run["overrides"], end_process_group=index == len(runs) - 1)
    else:
        main(args[0], "--unscaled" in args, [a for a in args[1:] if a != "--unscaled"])
