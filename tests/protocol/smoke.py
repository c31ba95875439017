"""What a finished run of the shipped cpu_smoke plan must show, whichever launcher ran it
(tests/protocol/test_end_to_end.py on this node, tests/slurm/ through a real controller)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from protocol.plan.model import REPO_ROOT

PLAN = REPO_ROOT / "protocol" / "plans" / "cpu_smoke.toml"
OUTPUT = Path("outputs") / "protocol" / "cpu_smoke"  # relative to where `protocol run` ran

# Proof in each run's log that the layout was really applied, not silently dropped.
APPLIED = {
    "3D FSDP+TP2+PP2": "PP 2 (Interleaved1F1B, 4 stages), TP 2 with sequence parallelism and loss parallelism, "
                       "FSDP over 2 ranks",
    "4D FSDP+TP2+CP2+PP2": "PP 2 (Interleaved1F1B, 4 stages), TP 2 with sequence parallelism and loss parallelism, "
                           "CP 2 (load-balanced ring attention), FSDP over 4 ranks",
    "2D FSDP+TP2 compiled": "TP 2 with sequence parallelism and loss parallelism, activation checkpointing "
                            "selective (2), torch.compile per block (inductor), FSDP over 2 ranks",
    "2D FSDP+CP2": "CP 2 (load-balanced ring attention), FSDP over 4 ranks",
    "AC full": "activation checkpointing full",
}


def check_report(out: Path, sets: set[str], run_log: Callable[[str], str], measured) -> None:
    """The report of `sets` (run and compared) in `out`: each PASSes within the parity targets of
    ARCHITECTURE.md (step-1 |loss diff| <= 1e-5, every step <= 1e-4, grad norms within 1e-5), each
    run's log (`run_log(name)`) names its layout, fingerprints agree, the markdown and figures are
    written."""
    report = json.loads((out / "report.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == sets
    for name, r in results.items():
        assert r["outcome"] == "PASS", (name, r["reason"])
        assert r["steps_compared"] == 20 and r["first_diverging_step"] is None
        assert abs(r["loss_diff"][0]) <= 1e-5 and r["max_abs_diff"] <= 1e-4
        assert r["grad_norm_first_rel_diff"] <= 1e-5 and r["grad_norm_max_rel_diff"] <= 1e-5
        assert r["final_loss"] < r["initial_loss"] - 0.2  # it trains
        assert APPLIED[name] in run_log(name), name
        measured(f"protocol cpu_smoke {name:20s} step-1 |dloss| {abs(r['loss_diff'][0]):.1e}, max |dloss| "
                 f"{r['max_abs_diff']:.1e}, grad-norm max rel diff {r['grad_norm_max_rel_diff']:.1e}, "
                 f"final loss {r['final_loss']:.5f}")
    for name, where in report["fingerprints"].items():  # no false alarm: every set's fingerprints agree
        assert where["first_step"] is None and where["norm_check"] is None, (name, where["summary"])
        assert where["steps"] == [1, 2, 3, 4], name
    assert set(report["fingerprints"]) == sets
    markdown = (out / "report.md").read_text()
    assert all(f"| {name} |" in markdown for name in results) and markdown.count("| PASS |") == len(sets)
    for png in ("loss.png", "grad_norm.png", "lr.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
