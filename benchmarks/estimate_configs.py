"""The estimator (python -m trainer.estimate) over the shipped configs: each at the smallest world
it claims and at twice that (FSDP shards over twice the ranks).

    python benchmarks/estimate_configs.py [--configs NAME ...] [--json FILE]

Each row is one `python -m trainer.estimate --job.config_file train_configs/<config> --nproc
<world> --json FILE` (with --host at the claimed world), read back from its JSON. Prints a table
per rank kind, the host peaks of the one-process jobs, and the wall time of each estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, GIB, machine, table  # noqa: I001 (sets sys.path)

WORLDS = {"debug_model": 1, "llama3_8b": 8, "llama3_70b": 64, "llama3_405b": 512}  # the smallest each claims
SMALL = 2 ** 20  # dimensions with less per step (the loss and gradient-norm all-reduces) left out


def estimate(config: str, nproc: int, host: bool, folder: Path) -> tuple[dict, float]:
    out = folder / f"{config}-{nproc}.json"
    command = [sys.executable, "-m", "trainer.estimate", "--job.config_file", f"train_configs/{config}.toml",
               "--nproc", str(nproc), "--json", str(out), *(["--host"] if host else [])]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[1:])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text()), seconds


def g(n: float) -> str:
    return f"{n / GIB:.2f}"


def layout(degrees: dict) -> str:
    parts = [f"{name} {size}" for name, size in degrees.items() if size > 1]
    return " × ".join(parts) or "1 rank"


def communication(collectives: dict) -> str:
    totals = {("world" if dim == "other" else dim): sum(op["bytes"] for op in ops.values())
              for dim, ops in collectives.items()}
    return ", ".join(f"{dim} {g(size)}" for dim, size in sorted(totals.items()) if size >= SMALL) or "-"


def rows(config: str, result: dict) -> list[list]:
    out = []
    memory = result["device_memory"]
    for r in result["ranks"]:
        s, step, init = r["state_bytes"], r["step_peak_bytes"], r["init_peak_bytes"]
        peak = max(step["total"], init["total"])
        out.append([config, result["nproc"], layout(result["degrees"]), f"{r['kind']}: {r['ranks']}",
                    f"{r['parameter_count'] / 1e6:,.1f}M",
                    f"{g(s['parameters'])} + {g(s['gradients'])} + {g(s['optimizer'])} = "
                    f"{g(s['parameters'] + s['gradients'] + s['optimizer'])}",
                    g(step["activations"]), g(step["temporaries"]), g(step["total"]), g(init["total"]),
                    f"{'yes' if r['fits'] else 'NO'} ({100 * peak / memory:.0f}%)", communication(r["collectives"])])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(WORLDS), choices=list(WORLDS))
    p.add_argument("--json", help="also write every estimate's JSON, in one list, to this file")
    a = p.parse_args()
    print(f"$ python {' '.join(sys.argv)}\n")
    print(f"{machine()}; load average at start {os.getloadavg()[0]:.1f}\n")
    started = time.perf_counter()
    results, memory_rows, host_rows, time_rows, change_lines = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for config in a.configs:
            for nproc in (WORLDS[config], 2 * WORLDS[config]):
                host = nproc == WORLDS[config] and config != "debug_model"
                result, seconds = estimate(config, nproc, host, Path(tmp))
                results.append(result)
                memory_rows += rows(config, result)
                time_rows.append([config, nproc, f"{seconds:.0f}",
                                  ", ".join(f"{r['seconds']:.0f}" for r in result["ranks"])])
                if result["host_bytes"]:
                    host_rows.append([config, *(f"{g(b)} ({b / 1e9:.1f} GB)" for b in result["host_bytes"].values())])
                    host_names = list(result["host_bytes"])
                for c in result["changes"]:
                    change_lines.append(f"- {config} at {nproc}: {c['change']}: " + (
                        f"peak {g(c['peak_bytes'])} GiB, {'fits' if c['fits'] else 'does not fit'}"
                        if c["peak_bytes"] is not None else f"cannot run ({c['reason']})"))
    print(table(["config", "world", "layout", "rank kind: ranks", "params", "weights + grads + optim GiB",
                 "activations GiB", "temporaries GiB", "step peak GiB", "init peak GiB", "fits 80 GiB (% of 80 GiB)",
                 "GiB per step by mesh dimension"], memory_rows, align="lrllrrrrrrll"))
    print("\nActivations and temporaries at the step peak; \"fits\": the larger of the two peaks within 90% "
          f"of the device; collectives: buffer bytes, dimensions under {SMALL // 2 ** 20} MiB left out.")
    if change_lines:
        print("\nChanges estimated for the jobs that do not fit:\n" + "\n".join(change_lines))
    if host_rows:
        print("\nHost memory of the one-process jobs, GiB (GB):\n")
        print(table(["config", *host_names], host_rows))
    print("\nWall time of each estimate (the whole command; its rank processes, two at a time):\n")
    print(table(["config", "world", "command s", "rank processes s"], time_rows))
    print(f"\nwhole run: {time.perf_counter() - started:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
