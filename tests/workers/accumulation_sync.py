"""Run under torchrun: one step's forward and backward of the trainer, twice on the same batch,
(1) as the trainer runs it and (2) with the all-reduce after every microbatch; prints the
collectives of each and the largest gradient difference between them (rank 0, one JSON line)."""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.collectives import CountCollectives
from trainer.config.manager import load_config, with_default_config
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import exit_without_teardown
from trainer.train import Trainer


def gradients_and_collectives(trainer: Trainer, batch) -> tuple[torch.Tensor, dict]:
    trainer.optimizer.zero_grad(set_to_none=True)
    with CountCollectives() as log:
        trainer.runner.forward_backward(batch)
    grads = torch.cat([p.grad.to_local().flatten() for p in trainer.model.parameters()])
    return grads, log.by_op()


def main() -> None:
    config = load_config(with_default_config(sys.argv[1:]))
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    batch = trainer.loader.next_batch()
    once, once_counts = gradients_and_collectives(trainer, batch)
    trainer.runner.replicated_roots = []  # every microbatch all-reduced, as without the skip
    every, every_counts = gradients_and_collectives(trainer, batch)
    if trainer.rank == 0:
        print(json.dumps({"once": once_counts, "every": every_counts, "microbatches": len(batch),
                          "max_diff": (once - every).abs().max().item(), "max_grad": every.abs().max().item()}))
    trainer.close()
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main()
