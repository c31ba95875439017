"""benchmarks/gpu_suite.sh, run as its CPU smoke run (GPU_SUITE_CPU_SMOKE=1): every part of the
GPU suite, the side-by-side comparison's dry run included, works before a GPU is ever lent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every part but two: document masking is benchmarks/document_masking.py, which
# tests/integration/test_benchmarks.py runs, and bench_1b_eager is bench_1b without compile.
PARTS = ("cuda_tests", "side_by_side_1b", "side_by_side_8b", "ring_kernels", "protocol_techniques", "estimate_1b",
         "bench_1b", "float8_8b", "protocol_float8", "cp_documents")


def test_cpu_smoke_run_of_the_gpu_suite(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_SUITE_CPU_SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable,
           "GPU_SUITE_XDIST_WORKERS": "1", "GPU_SUITE_PARTS": " ".join(PARTS)}
    done = subprocess.run(["bash", "benchmarks/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.md").read_text()

    # Every part ran and ended ok (none skipped for lack of time).
    status = dict(re.findall(r"^\| (\w+) \| ([^|]+?) \|", summary.split("## Parts")[1], re.M))
    assert {part: status.get(part) for part in PARTS} == {part: "ok" for part in PARTS}, status

    # The side-by-side dry runs measured the trainer and the plain loop (torchtitan only where installed).
    for title in ("1B", "8B cut to 8 layers"):
        section = summary.split(f"## Side by side, {title}")[1].split("\n## ")[0]
        rows = {cells[1]: cells for cells in (
            [c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| seq "))}
        assert {"trainer", "plain"} <= set(rows), section
        for system in rows:
            assert rows[system][2] == "ok", rows[system]
            assert float(rows[system][3].replace(",", "")) > 0, rows[system]  # tokens/s
        assert rows["trainer"][4] == "1.00x"
    # The technique plan is expanded and checked (its runs need a GPU's speed): every run listed.
    plan = summary.split("## Technique plan")[1]
    for run in ("seed", "1 GPU eager-noise4", "torch.compile", "AC full", "lr x1.05"):
        assert run in plan, plan
    float8 = summary.split("## Side by side, 8B cut to 8 layers, bf16 and float8")[1].split("\n## ")[0]
    assert re.search(r"^\| seq 64, eager, AC selective, float8 tensorwise \| trainer \| ok \| [\d,]+ \|", float8,
                     re.M), float8
    plan = summary.split("## float8 plan")[1]
    for run in ("seed", "bfloat16-noise4", "float8 tensorwise", "float8 rowwise", "lr x1.05"):
        assert run in plan, plan
    ring = summary.split("## Ring attention kernels")[1].split("\n## ")[0]
    assert re.search(r"^\| 256 +\| 2 +\| 0 +\| +[\d.]+ \|", ring, re.M), ring
    documents = summary.split("## Ring attention with documents")[1].split("\n## ")[0]
    assert re.search(r"^\| 2,048 +\| +cpu flash \| +4 \| +[\d.]+ \|", documents, re.M), documents
    assert "16 passed" not in summary  # the smoke run takes one CUDA test file, on the CPU
    assert re.search(r"\d+ passed, 0 failed, 0 errors", summary)
    for name in ("summary.md", "suite.log", "cuda_tests.xml", "details.tar.gz"):
        assert (out / name).stat().st_size > 0, name
