"""python -m trainer.estimate --nproc N [--rank R] [--device-memory 80GiB] [--steps K]
                              [--json FILE] [--strict] [--host] [training overrides ...]

Runs one rank of each kind (every rank alike without pipeline parallelism; the first, a middle
and the last pipeline rank with it), or the given --rank, of the configured job at world size N
on fake tensors and a fake process group, and prints what each rank holds and allocates, the
collectives of one step, and whether it fits the device. For a rank that does not fit, the usual
remedies that apply to the job (full activation checkpointing, half the local batch, resharding
after forward under PP, twice the ranks) are each estimated again and reported with their peak. --strict exits 2 when a
rank does not fit (put it in front of a cluster launch); --host adds the host memory of the one-process jobs
(seed checkpoint, Hugging Face export).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import time

from trainer import messages
from trainer.config.manager import ConfigError
from trainer.estimate.changes import try_changes
from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.hf.export import parse_size

logger = logging.getLogger("trainer.estimate")


def memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:  # argparse then names the option and exits with status 2
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="world size of the job (all ranks, all nodes)")
    p.add_argument("--rank", type=int, help="estimate this global rank only")
    p.add_argument("--all-rank-kinds", action="store_true", help="one rank of each kind (the default)")
    p.add_argument("--device-memory", type=memory_size, default=memory_size("80GiB"),
                   help="memory of one device (default 80GiB)")
    p.add_argument("--steps", type=int, default=1, help="training steps to run (default 1)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--strict", action="store_true", help="exit 2 when a rank does not fit the device memory")
    p.add_argument("--no-changes", action="store_true",
                   help="for a rank that does not fit, do not estimate the usual remedies")
    p.add_argument("--host", action="store_true", help="also the host memory of the seed checkpoint and HF export")
    return p


def run(a, overrides: list[str]) -> int:
    from trainer.estimate import report
    from trainer.estimate.rank import RankKind, rank_kinds
    from trainer.parallel.dims import stage_plan
    from trainer.preflight.checks import describe_degrees, plan_layout

    config, notes = estimated_config(overrides)
    plan = plan_layout(config, a.nproc)
    dims = plan.dims
    kinds = rank_kinds(dims, stage_plan(config, dims))
    if a.rank is not None:
        if not 0 <= a.rank < a.nproc:
            raise ConfigError(f"--rank {a.rank}: the world has ranks 0-{a.nproc - 1}")
        kind = next(k for k in kinds if a.rank in k)
        kinds = [RankKind(f"rank {a.rank} ({kind.name})", a.rank, a.rank, a.rank, kind.stages)]
    print(f"{config.model.flavor} at {a.nproc} ranks: {describe_degrees(dims)}; global batch "
          f"{plan.global_batch_size} x {config.training.seq_len} tokens, local batch {config.training.local_batch_size}"
          f" ({plan.accumulation_steps} accumulation steps); AC {config.activation_checkpoint.mode}"
          + "".join(f"; {n}" for n in notes), flush=True)
    started = time.perf_counter()
    estimates = estimate_kinds(overrides, a.nproc, kinds, a.steps)
    print(report.memory_table(estimates, a.device_memory))
    print("communication of one step per rank (buffer bytes):")
    for e in estimates:
        for line in report.communication_lines(e):
            print(f"  {e.kind.name}: {line}")
    host = _host_figures(config) if a.host else None
    if host:
        print("host memory: " + "; ".join(f"{name} {report.gib(size)} GiB" for name, size in host.items()))
    print(f"estimated in {time.perf_counter() - started:.0f} s")  # the remedies below take their own time
    too_big = [e for e in estimates if not report.fits(e, a.device_memory)]
    for e in too_big:
        print("warning: " + report.advice(e, a.device_memory))
    tried = []
    if too_big and not a.no_changes:
        print("changes, each estimated again (all rank kinds):", flush=True)
        tried = try_changes(overrides, config, plan, a.nproc, a.steps, report.usable(a.device_memory))
        print("\n".join(report.change_lines(tried)))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"flavor": config.model.flavor, "nproc": a.nproc, "degrees": dims.degrees(),
                       "device_memory": a.device_memory, "ranks": report.as_json(estimates, a.device_memory),
                       "host_bytes": host, "changes": [report.change_json(t) for t in tried]}, f, indent=1)
    return 2 if too_big and a.strict else 0


def _host_figures(config) -> dict[str, int]:
    import torch

    from trainer.estimate.host import export_peak_bytes, seed_peak_bytes

    streaming, whole = export_peak_bytes(config, torch.bfloat16, 5 * 10 ** 9)
    return {"seed checkpoint": seed_peak_bytes(config), "HF export bf16 (5 GB shards)": streaming,
            "HF export bf16, whole model at once": whole}


def check_overrides(p: argparse.ArgumentParser, overrides: list[str]) -> None:
    """What argparse did not take must be training options (--section.key): a mistyped option of
    the estimator gets its name suggested, not the config loader's message."""
    options = [o for action in p._actions for o in action.option_strings if o.startswith("--")]
    for word in overrides:
        name = word.split("=", 1)[0]
        if name.startswith("--") and "." not in name:
            close = difflib.get_close_matches(name, options, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{name}: not an option of python -m trainer.estimate ({', '.join(options)}) nor a "
                              f"training option (--section.key value){hint}")


def main(argv: list[str] | None = None) -> int:
    messages.configure()
    p = parser()
    a, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        check_overrides(p, overrides)
        return run(a, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
