"""Run under torchrun: build the trainer (which perturbs its initial weights when asked), gather
every parameter whole, and save them from rank 0 to the file named first on the command line."""

from __future__ import annotations

import os
import sys

import torch

from trainer.config.manager import load_config, with_default_config
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import exit_without_teardown
from trainer.train import Trainer


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    config = load_config(with_default_config(args))
    trainer = Trainer(config, plan_run(config, int(os.environ.get("WORLD_SIZE", "1"))))
    weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for name, p in trainer.model.named_parameters()}
    if trainer.rank == 0:
        torch.save(weights, out)
    trainer.close()
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main()
