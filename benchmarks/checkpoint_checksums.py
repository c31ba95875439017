"""What checksums cost a checkpoint's save and load: the model of a flavor (default the 1B) saved
with torch's FileSystemWriter and with the trainer's ChecksumWriter, and read back with torch's
FileSystemReader, the trainer's CheckedReader without verification and with it. One process,
the tensors in host memory, files fsynced as DCP does, the page cache dropped before each save
and load (as root), so that loads read the disk; each figure is the median of --repeats.

    python benchmarks/checkpoint_checksums.py [--flavor 1B] [--dtype float32] [--repeats 3] [--folder DIR]

Prints one table: wall-clock seconds per save or load (median and fastest), and the CPU
seconds of the process (every thread): the hashing's own cost, which the wall clock hides when
a core is free while the disk works.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from trainer.checkpoint.checksums import ChecksumWriter  # noqa: E402
from trainer.checkpoint.checked_reader import CheckedReader  # noqa: E402
from trainer.models.llama3.args import FLAVORS  # noqa: E402
from trainer.models.llama3.model import Transformer  # noqa: E402


def model_state(flavor: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The flavor's parameters with random values (what is hashed does not depend on them)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(FLAVORS[flavor]).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in shapes.items()}


def timed(action) -> tuple[float, float]:
    """Wall-clock and CPU seconds (of every thread of this process) of `action`."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def cold_start() -> bool:
    """Write out and drop the page cache (needs root), so that each save and load starts from
    the same state and each load reads from the disk; False when that is not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def measure(state: dict, folder: Path, repeats: int) -> tuple[dict[str, list[tuple[float, float]]], bool]:
    """Seconds of each save and load variant, interleaved so that the disk's state affects all
    alike, each from a cold page cache where allowed (returned: whether it was)."""
    plain, checked = folder / "plain", folder / "checked"
    empty = {name: torch.empty_like(t) for name, t in state.items()}
    times: dict[str, list[tuple[float, float]]] = {}
    cold = True
    for _ in range(repeats):
        for path in (plain, checked):
            shutil.rmtree(path, ignore_errors=True)
        runs = {
            "save, torch FileSystemWriter": lambda: dcp.save(state, checkpoint_id=str(plain), no_dist=True),
            "save, ChecksumWriter": lambda: dcp.save(state, storage_writer=ChecksumWriter(checked), no_dist=True),
            "load, torch FileSystemReader": lambda: dcp.load(empty, checkpoint_id=str(plain), no_dist=True),
            "load, CheckedReader unverified": lambda: dcp.load(
                empty, storage_reader=CheckedReader(checked, verify=False), no_dist=True),
            "load, CheckedReader verified": lambda: dcp.load(
                empty, storage_reader=CheckedReader(checked, verify=True), no_dist=True),
        }
        for name, run in runs.items():
            cold = cold_start() and cold
            times.setdefault(name, []).append(timed(run))
    return times, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    state = model_state(args.flavor, getattr(torch, args.dtype))
    size = sum(t.numel() * t.element_size() for t in state.values())
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=args.folder) as folder:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        measured, cold = measure(state, Path(folder), args.repeats)
    print(f"flavor {args.flavor}, {args.dtype}, {len(state)} tensors, {size / 2**30:.2f} GiB; {args.repeats} repeats; "
          f"{'page cache dropped before each' if cold else 'page cache NOT dropped (not root)'}; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"{'variant':32} {'median s':>9} {'min s':>7} {'GiB/s':>6} {'vs torch':>9} {'CPU s':>7} {'CPU vs torch':>13}")
    base = {}
    for name, values in measured.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        kind = name.split(",")[0]
        base.setdefault(kind, (wall, cpu))
        print(f"{name:32} {wall:9.2f} {min(w for w, _ in values):7.2f} {size / 2**30 / wall:6.2f} "
              f"{wall / base[kind][0] - 1:+9.1%} {cpu:7.2f} {cpu - base[kind][1]:+12.2f}s")


if __name__ == "__main__":
    main()
