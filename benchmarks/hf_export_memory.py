"""Host memory of the Hugging Face export, measured against trainer.hf.export's predictions.

    python benchmarks/hf_export_memory.py [--flavors 125M,1B] [--dtypes float32,bfloat16]
                                          [--shard-sizes 50MB,200MB] [--work-dir DIR]

For each flavor it saves a DCP checkpoint of the initialized model (float32, `{"model": ...}`
with dcp.save, as one process saves a seed), then exports it in a fresh child process per case:

* streaming: `python -m trainer.hf export ... --max-shard-size S` (its main(), in the child);
* whole model: the export as it was before streaming (read_model_state, then every tensor
  converted and cast, one model.safetensors), reproduced in `whole_model_export` below.

Measured: the child's peak resident set (VmHWM) minus its resident set (VmRSS) once warmed up
(imports done and both exports run once on a `tiny` checkpoint, which starts torch's thread pools
and DCP's lazy imports: about 40 MB, whatever the model), i.e. what exporting this model added.
Not ru_maxrss: Linux carries the parent's resident set into it across fork and exec, so a child
of a parent holding a model reports at least that. Predicted:
export_host_peak_bytes / whole_model_export_peak_bytes from the model's shapes. Sizes are in
powers of 1000 (MB, GB), as --max-shard-size. Then the predictions for 8B, 70B and 405B.
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, machine, table  # noqa: I001 (sets sys.path)

MB = 10**6
GB = 10**9


def status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def whole_model_export(checkpoint: Path, out: Path, args, dtype) -> int:
    """The former export (trainer/hf/folder.py write_hf_folder fed by read_model_state): the whole
    model read, converted and cast at once, written as one file. Returns the files written."""
    from safetensors.torch import save_file

    from trainer.checkpoint.dcp_read import read_model_state
    from trainer.hf.weights import to_hf

    state = read_model_state(checkpoint)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf(state, args).items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return 1


def export(case: dict, flavor: str, dcp: str, out: Path) -> None:
    import torch

    from trainer.hf.__main__ import main
    from trainer.models.llama3.hf_config import model_args

    if case["path"] == "streaming":
        status = main(["export", "--dcp", dcp, "--flavor", flavor, "--out", str(out), "--dtype", case["dtype"],
                       "--max-shard-size", case["shard"]])
        assert status == 0, status
    else:
        whole_model_export(Path(dcp), out, model_args(flavor), getattr(torch, case["dtype"]))


def child(case: dict) -> None:
    """One export in this fresh process, after a warm-up; prints its memory figures as JSON."""
    out = Path(case["out"])
    for path in ("streaming", "whole model"):
        export({**case, "path": path, "shard": "200KB"}, "tiny", case["warm_up"], out)  # several shards
        shutil.rmtree(out)
    baseline = status_bytes("VmRSS")
    start = time.perf_counter()
    export(case, case["flavor"], case["dcp"], out)
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline": baseline, "peak": status_bytes("VmHWM"), "seconds": seconds,
                      "files": len(list(out.glob("*.safetensors")))}))


def save_checkpoint(flavor: str, folder: Path) -> int:
    """A float32 DCP checkpoint of the initialized model; returns its parameter count."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.models.llama3 import Transformer
    from trainer.models.llama3.hf_config import model_args

    model = Transformer(model_args(flavor))
    model.init_weights(0)
    params = dict(model.named_parameters())  # a tied output is the embedding: saved once, as a checkpoint does
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": params}, checkpoint_id=str(folder), no_dist=True)
    return sum(p.numel() for p in params.values())


def run_case(case: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True,
                            text=True, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"export failed ({case}):\n{result.stderr}")
    shutil.rmtree(case["out"])
    return json.loads(result.stdout.strip().splitlines()[-1])


def predicted(case: dict) -> int:
    import torch

    from trainer.hf.export import export_host_peak_bytes, parse_size, whole_model_export_peak_bytes
    from trainer.models.llama3.hf_config import model_args

    args, dtype = model_args(case["flavor"]), getattr(torch, case["dtype"])
    if case["path"] == "streaming":
        return export_host_peak_bytes(args, dtype, parse_size(case["shard"]))
    return whole_model_export_peak_bytes(args, dtype)


def measure(flavors: list[str], dtypes: list[str], shards: list[str], work: Path) -> str:
    rows = []
    save_checkpoint("tiny", work / "dcp-tiny")
    for flavor in flavors:
        checkpoint = work / f"dcp-{flavor}"
        params = save_checkpoint(flavor, checkpoint)
        for dtype in dtypes:
            cases = [dict(path="streaming", shard=s) for s in shards] + [dict(path="whole model", shard="-")]
            for case in cases:
                case.update(flavor=flavor, dtype=dtype, dcp=str(checkpoint), out=str(work / "out"),
                            warm_up=str(work / "dcp-tiny"))
                got, want = run_case(case), predicted(case)
                growth = got["peak"] - got["baseline"]
                rows.append([f"{flavor} ({params / 1e6:,.0f}M)", case["path"], dtype, case["shard"], got["files"],
                             f"{growth / MB:,.0f}", f"{want / MB:,.0f}", f"{growth / want:.2f}",
                             f"{got['seconds']:.1f}"])
        shutil.rmtree(checkpoint)
    return table(["model", "export", "dtype", "shard size", "files", "measured peak growth MB", "predicted MB",
                  "measured / predicted", "seconds"], rows, "lllllrrrr")


def large_models() -> str:
    """The predictions for the published sizes at transformers' default shard size."""
    import torch

    from trainer.hf.export import export_host_peak_bytes, whole_model_export_peak_bytes
    from trainer.hf.folder import DEFAULT_SHARD_BYTES
    from trainer.models.llama3.hf_config import model_args

    rows = []
    for flavor in ("8B", "70B", "405B"):
        for dtype in (torch.bfloat16, torch.float32):
            args = model_args(flavor)
            streaming = export_host_peak_bytes(args, dtype, DEFAULT_SHARD_BYTES)
            whole = whole_model_export_peak_bytes(args, dtype)
            rows.append([flavor, str(dtype).removeprefix("torch."), f"{streaming / GB:,.1f}", f"{whole / GB:,.1f}"])
    return table(["model", "dtype", "streaming export, 5GB shards: GB", "whole-model export: GB"], rows, "llrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", default="125M")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shard-sizes", default="50MB,200MB")
    parser.add_argument("--work-dir", default="", help="where the checkpoints and exports are written (default: a "
                                                       "temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        return child(json.loads(a.child))
    with tempfile.TemporaryDirectory(dir=a.work_dir or None) as work:
        print(measure(a.flavors.split(","), a.dtypes.split(","), a.shard_sizes.split(","), Path(work)))
    print(f"\n{machine()}\n")
    print(large_models())


if __name__ == "__main__":
    main()
