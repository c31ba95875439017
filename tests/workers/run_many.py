"""Run under torchrun: several short training runs, one after the other, in one process group.

    torchrun ... -m tests.workers.run_many SPEC.json RESULTS.json

SPEC: {"base": [overrides of every run], "runs": [{"name": ..., "overrides": [...]}, ...]}.
Each run is the trainer's own (`Trainer`, its `train` loop, metrics.jsonl in
`<dump root>/<name>`, or in the --job.dump_folder the spec names), so the long tail of a
combination matrix pays the process start, the import of torch and the creation of the process
group once. Between runs the compiled code is dropped (`torch._dynamo.reset`), so no run reuses
another's graphs or hits the recompile limit.
Rank 0 writes RESULTS: name -> {"metrics": [per-step records], "graphs": graphs compiled,
"graph_breaks": graph breaks, "seconds": wall time, "log": what rank 0 logged during the run
(what the launcher shows of a run, LOG_RANK=0), "dump": its dump folder}.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from trainer.config.manager import load_config, with_default_config
from trainer.messages import MessageFormat
from trainer.preflight.checks import plan_run
from trainer.launch.process_exit import exit_without_teardown
from trainer.train import Trainer, configure_logging


def run_one(base: list[str], run: dict, dump_root: Path) -> dict:
    torch._dynamo.reset()
    counters.clear()
    args = [*base, *run["overrides"]]
    if "--job.dump_folder" in args:  # a folder named by the spec (it may hold a checkpoint to resume)
        dump = Path(args[max(i for i, arg in enumerate(args) if arg == "--job.dump_folder") + 1])  # the last wins
    else:
        dump = dump_root / run["name"].replace(" ", "_").replace("+", "_")
        args.extend(["--job.dump_folder", str(dump)])
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setFormatter(MessageFormat())
    logging.getLogger().addHandler(handler)
    try:
        config = load_config(with_default_config(args))
        start = time.perf_counter()
        trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
        try:
            trainer.train()
        finally:
            trainer.close(end_process_group=False)
    finally:
        logging.getLogger().removeHandler(handler)
    metrics = []
    if trainer.rank == 0:
        with open(dump / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f]
    return {"metrics": metrics, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "seconds": time.perf_counter() - start,
            "log": log.getvalue() if trainer.rank == 0 else "", "dump": str(dump)}


def main() -> None:
    configure_logging()
    spec = json.loads(Path(sys.argv[1]).read_text())
    results_path = Path(sys.argv[2])
    results = {run["name"]: run_one(spec["base"], run, results_path.parent) for run in spec["runs"]}
    if int(os.environ["RANK"]) == 0:
        results_path.write_text(json.dumps(results))
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main()
