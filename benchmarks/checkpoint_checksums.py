"""What checksums cost a checkpoint's save and load: the model of a flavor (default the 1B) saved
with torch's FileSystemWriter and with the trainer's ChecksumWriter, and read back with torch's
FileSystemReader, the trainer's CheckedReader without verification and with it. One process,
the tensors in host memory, files fsynced as DCP does; each figure is the median of --repeats.

    python benchmarks/checkpoint_checksums.py [--flavor 1B] [--dtype float32] [--repeats 3] [--folder DIR]

Prints one table: seconds per save or load, and the checksums' share of it.
"""

from __future__ import annotations

import argparse
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

from trainer.checkpoint_checksums import ChecksumWriter  # noqa: E402
from trainer.dcp_metadata import CheckedReader  # noqa: E402
from trainer.models.llama3.args import FLAVORS  # noqa: E402
from trainer.models.llama3.model import Transformer  # noqa: E402


def model_state(flavor: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The flavor's parameters with random values (what is hashed does not depend on them)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(FLAVORS[flavor]).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in shapes.items()}


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(state: dict, folder: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each save and load variant, interleaved so that the disk's state affects all alike."""
    plain, checked = folder / "plain", folder / "checked"
    empty = {name: torch.empty_like(t) for name, t in state.items()}
    times: dict[str, list[float]] = {}
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
            times.setdefault(name, []).append(timed(run))
    return times


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
        times = {name: statistics.median(values) for name, values in measure(state, Path(folder), args.repeats).items()}
    print(f"flavor {args.flavor}, {args.dtype}, {len(state)} tensors, {size / 2**30:.2f} GiB; median of "
          f"{args.repeats}; torch {torch.__version__}")
    print(f"{'variant':34} {'seconds':>8} {'GiB/s':>7} {'vs torch':>9}")
    base = {"save": times["save, torch FileSystemWriter"], "load": times["load, torch FileSystemReader"]}
    for name, seconds in times.items():
        share = seconds / base[name.split(",")[0]] - 1
        print(f"{name:34} {seconds:8.2f} {size / 2**30 / seconds:7.2f} {share:+9.1%}")


if __name__ == "__main__":
    main()
