"""The estimator against real runs (benchmarks/estimate_accuracy.py, tiny model): the same job on
CPU once for real under torchrun (gloo) and once on fake tensors in a fake world. What each rank
kind holds (parameters, gradients, optimizer state) must be equal to the byte in every layout the
benchmark covers (1 process, FSDP, FSDP x TP, PP Interleaved1F1B, CP, FSDP x TP x PP with full and
selective AC); the step peaks of the tracker over real and fake tensors must agree within 5%
(docs/performance.md gives the figures for larger models)."""

from __future__ import annotations

import json

from tests.integration.test_benchmarks import run_script


def test_estimated_state_bytes_equal_the_real_runs(tmp_path, measured):
    run_script("estimate_accuracy.py", "--flavor", "tiny", "--seq-len", "32", "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len({row["layout"] for row in rows}) == 7
    assert {row["kind"] for row in rows} == {"every rank", "first pipeline rank (0)", "last pipeline rank (1)"}
    for row in rows:
        assert row["estimated_state"] == row["real_state"], row
        difference = row["estimated_peak"] / row["real_peak"] - 1
        assert abs(difference) < 0.05, row
        measured(f"estimate vs real (tiny), {row['layout']:36s} {row['kind']:24s}: state {sum(row['real_state'])} B "
                 f"equal; step peak {row['estimated_peak']} B estimated, {row['real_peak']} B real "
                 f"({100 * difference:+.1f}%)")
