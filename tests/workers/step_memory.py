"""Run under torchrun: the trainer builds its model and runs one training step for real, and each
rank writes what it holds (the estimator's exact counting) and the peak memory of the step (the
estimator's tracker, over real tensors) to OUT/rank<R>.json. tests/integration/test_estimate_vs_real.py
compares them with the estimator's fake run of the same job."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer.config.manager import load_config, with_default_config
from trainer.estimate.rank import state_bytes
from trainer.estimate.step_memory import StepMemory
from trainer.preflight import plan_run
from trainer.process_exit import exit_without_teardown
from trainer.train import Trainer


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    config = load_config(with_default_config(overrides))
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    batch = trainer.loader.next_batch()
    memory = StepMemory()
    memory.track_external(trainer.model, trainer.optimizer)
    with memory:
        trainer.runner.forward_backward(batch)
        state = state_bytes(trainer.model, trainer.optimizer)
        trainer._clip()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    figures = {"parameters": state.parameters, "gradients": state.gradients, "optimizer": state.optimizer,
               "step_peak": memory.peak().as_dict()}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(figures))
    trainer.close()
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main()
