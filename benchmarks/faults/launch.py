"""The power study's launcher: torchrun_launch.sh, with a fault injected into the runs that carry one.

    PROTOCOL_FAULTS='{"<dump folder>": "<fault>", ...}' python benchmarks/faults/launch.py [trainer options]

The protocol's local runner calls it in place of torchrun_launch.sh (benchmarks/protocol_power.py
passes it). A run whose --job.dump_folder is listed gets PROTOCOL_FAULT set and this folder first
on PYTHONPATH, so that sitecustomize.py patches the trainer in every one of its processes; every
other run is started exactly as torchrun_launch.sh would start it.
"""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE.parents[1] / "torchrun_launch.sh"


def dump_folder(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--job.dump_folder" and i + 1 < len(args):
            return str(Path(args[i + 1]).resolve())
        if arg.startswith("--job.dump_folder="):
            return str(Path(arg.split("=", 1)[1]).resolve())
    return None


def main() -> None:
    args = sys.argv[1:]
    faults = {str(Path(folder).resolve()): fault for folder, fault in json.loads(os.environ.get("PROTOCOL_FAULTS", "{}")).items()}
    fault = faults.get(dump_folder(args) or "")
    env = dict(os.environ)
    env.pop("PROTOCOL_FAULT", None)
    if fault:
        env["PROTOCOL_FAULT"] = fault
        env["PYTHONPATH"] = f"{HERE}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(HERE)
    os.execve(str(LAUNCHER), [str(LAUNCHER), *args], env)


if __name__ == "__main__":
    main()
