"""A stand-in for torchrun_launch.sh in protocol tests: it writes what a real run writes (the run
record, metrics.jsonl, the seed checkpoint with its checkpoint.json) in a fraction of a second.

The record's configuration is the trainer's own resolution of the arguments (load_config); the
code and torch versions come from FAKE_CODE / FAKE_TORCH, which the tests also give the protocol
as "now", so a trainer file edited while the tests run cannot change their outcome.

Environment (comma-separated run folder names):
  FAKE_CALLS   file the calls are appended to (JSON lines)
  FAKE_FAIL    runs that print the launcher's error block and exit 2
  FAKE_NOISE   runs that fail with torchrun's report only (no error block), exit 1
  FAKE_KILL    runs that kill themselves with SIGKILL
  FAKE_SHORT   runs that exit 0 but log one step too few (their record stays "running")
  FAKE_ROUNDING  when set, every run's loss and grad norm get their own small noise (seeded by the
                 run's folder name), as bf16 runs that differ only in rounding would
  FAKE_OFFSET  JSON {run folder: number} added to that run's training and validation losses
  FAKE_SYNCS   JSON {run folder: number}: that run's record counts this many tensor-parallel syncs
               per forward pass ("collectives", as metrics.count_collectives writes it)
  FAKE_STEP_TIME  JSON {run folder: seconds}: the step time it logs (default 0.5)
  FAKE_SLEEP   JSON {run folder: seconds}: that run sleeps after each step, writing metrics.jsonl as it
               goes (a running run)

With validation.enable the run logs "validation/loss" (its training loss + 1) at every
validation.freq-th step and the last, as the trainer does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

FAKE_CODE = {"commit": "3f2a1c9d" + "0" * 32, "dirty": False, "source_sha256": "a" * 64}
FAKE_TORCH = "2.13.0+cpu"


def named(variable: str, run: str) -> bool:
    return run in os.environ.get(variable, "").split(",")


def arg(args: list[str], key: str) -> str | None:
    return args[args.index(key) + 1] if key in args else None


def write_seed(dump: Path, config: dict) -> None:
    step0 = dump / config["checkpoint"]["folder"] / "step-0"
    step0.mkdir(parents=True)
    (step0 / ".metadata").write_text(uuid.uuid4().hex)  # every save differs, as DCP's save id does
    record = {"step": 0, "items": ["model"], "kind": "seed", "config": config,
              "code": json.loads(os.environ["FAKE_CODE"]), "torch": os.environ["FAKE_TORCH"],
              "saved": "2025-01-01T00:00:00+00:00"}
    (step0 / "checkpoint.json").write_text(json.dumps(record))


def per_run(variable: str, run: str, default: float | None = None) -> float | None:
    return json.loads(os.environ.get(variable) or "{}").get(run, default)


def write_run(dump: Path, config: dict, ngpu: int, steps: int, status: str = "completed") -> None:
    from trainer.checkpoint.on_disk import fingerprint
    from trainer.records.run_meta import begin, finish, write_record

    load = config["checkpoint"].get("initial_load_path")
    start = {"kind": "checkpoint", "path": load, "step": 0, "fingerprint": fingerprint(Path(load))} if load else \
        {"kind": "init", "path": None, "step": 0, "fingerprint": None}
    p = config["parallelism"]
    degrees = {"pp": p["pipeline_parallel_degree"], "dp_replicate": p["data_parallel_replicate_degree"],
               "dp_shard": p["data_parallel_shard_degree"], "cp": p["context_parallel_degree"],
               "tp": p["tensor_parallel_degree"]}
    record = begin(dump, {"config": config, "code": json.loads(os.environ["FAKE_CODE"]), "start": start,
                          "world_size": ngpu, "degrees": degrees, "torch": os.environ["FAKE_TORCH"]}, 0)
    syncs = per_run("FAKE_SYNCS", dump.name)
    if syncs is not None:  # the trainer records them after its first step
        record["collectives"] = {"step": 1, "rank": 0, "by_dimension": {}, "forward_passes": 1,
                                 "tp_syncs_per_forward": syncs}
        write_record(dump, record)
    lr = config["optimizer"]["lr"]
    noise = rounding_noise(dump.name, steps)
    offset, step_time = per_run("FAKE_OFFSET", dump.name, 0.0), per_run("FAKE_STEP_TIME", dump.name, 0.5)
    validation = config["validation"]
    with open(dump / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            loss, norm = 5.0 - step * lr * 10 + noise[step - 1] + offset, 1.0 + noise[step - 1]
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": norm, "lr": lr, "step_time_s": step_time})
                    + "\n")
            if validation["enable"] and (step % validation["freq"] == 0 or step == config["training"]["steps"]):
                f.write(json.dumps({"step": step, "kind": "validation", "validation/loss": loss + 1.0}) + "\n")
            f.flush()
            time.sleep(per_run("FAKE_SLEEP", dump.name, 0.0))
        f.write(json.dumps({"kind": "validation", "step": 1000}) + "\n")
    finish(dump, record, status, steps)


def rounding_noise(run: str, steps: int) -> list[float]:
    """Zeros, or (FAKE_ROUNDING) a random walk of 1e-4 steps seeded by the run's name."""
    if not os.environ.get("FAKE_ROUNDING"):
        return [0.0] * steps
    import random

    generator, walk, total = random.Random(run), [], 0.0
    for _ in range(steps):
        total = 0.9 * total + generator.gauss(0.0, 1e-4)
        walk.append(total)
    return walk


def main(args: list[str]) -> int:
    from trainer.config.manager import load_config, to_dict

    dump = Path(arg(args, "--job.dump_folder"))
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps({"run": dump.name, "ngpu": os.environ.get("NGPU"), "cwd": os.getcwd(),
                            "python": os.environ.get("PYTHON")}) + "\n")
    print("starting", dump.name, flush=True)
    if named("FAKE_KILL", dump.name):
        os.kill(os.getpid(), signal.SIGKILL)
    if named("FAKE_FAIL", dump.name):
        print("[rank0]: Traceback (most recent call last): ... the real error is here")
        print("error: rank 1: the run broke: tensor_parallel_degree=3 does not divide 4 heads\n  (a second line)")
        print(f"full logs: {dump}/logs")
        return 2
    if named("FAKE_NOISE", dump.name):
        print("\n".join(f"boilerplate line {i}" for i in range(30)))
        print("error_file: <N/A>\ntraceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        return 1
    config = json.loads(json.dumps(to_dict(load_config(args)), default=str))
    dump.mkdir(parents=True, exist_ok=True)
    if "--checkpoint.create_seed_checkpoint" in args:
        write_seed(dump, config)
        return 0
    steps = config["training"]["steps"]
    short = named("FAKE_SHORT", dump.name)
    write_run(dump, config, int(os.environ.get("NGPU", "2")), steps - short, "running" if short else "completed")
    print("finished", dump.name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
