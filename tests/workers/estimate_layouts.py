"""Run under torchrun: benchmarks/estimate_accuracy.py's own worker (one real training step, what
each rank holds and the step peak of the estimator's memory tracker) for several layouts of one
process count, one after the other in one process group.

    torchrun ... -m tests.workers.estimate_layouts SPEC.json

SPEC: [{"out": folder for the ranks' figures, "overrides": [...]}, ...], each as the benchmark's
`real_run` would start its worker. The worker ends its process after one layout; here its trainer
leaves the process group to the next layout and the process goes on, so the layouts of one
process count pay the start of torch once.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import trainer.launch.process_exit
from tests.launch import REPO
from trainer.train import Trainer

sys.path.insert(0, str(REPO / "benchmarks"))
import estimate_accuracy  # noqa: E402  (benchmarks/ on sys.path)


def main() -> None:
    layouts = json.loads(Path(sys.argv[1]).read_text())
    close, exit_without_teardown = Trainer.close, trainer.launch.process_exit.exit_without_teardown
    Trainer.close = lambda self, end_process_group=True: close(self, end_process_group=False)
    trainer.launch.process_exit.exit_without_teardown = lambda code=0: None  # the worker's last call
    for layout in layouts:
        estimate_accuracy.worker(Path(layout["out"]), layout["overrides"])
        gc.collect()  # the layout's model and optimizer, before the next one is built
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main()
