"""The blocks' activation fingerprints (trainer/metrics/fingerprints.py), the attention and feed-forward
branches (attention_rms, ffn_rms) with the block output and gradient, are the same global figures
in every layout: one process against full activation checkpointing, gradient accumulation,
torch.compile (inductor, with and without full recomputation), FSDP over 2 ranks, TP 2 with
sequence parallelism (eager, and compiled with aot_eager: the tracing of DTensor blocks, without
generating kernels on 2 CPU cores), CP 2 and PP 2 (Interleaved1F1B, 2 microbatches).

3 steps of the tiny Llama in fp32 with deterministic algorithms, from the same initial weights
(init is layout-invariant) on the same global batches, recorded at steps 1 and 3 (step 2 runs the
compiled blocks' graph without the branches): every figure within FINGERPRINT_TOLERANCE (1e-4
relative, the parity matrix's) of the one-process run. The 1-process runs share one process and
the 2-process runs one process group (tests/workers/run_many.py). Every pipeline schedule and
the FSDP x TP x PP layouts compare these figures in the parity matrix
(tests/integration/test_parallel_parity.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_many
from trainer.records.run_meta import BLOCK_QUANTITIES, BRANCH_QUANTITIES

FINGERPRINT_TOLERANCE = 1e-4
BASE = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "3",
        "--training.local_batch_size", "4", "--optimizer.lr", "3e-3", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard",
        "--debug.deterministic", "--checkpoint.no_enable", "--metrics.fingerprints",
        "--metrics.fingerprint_first", "1", "--metrics.fingerprint_every", "3"]
AC_FULL = ["--activation_checkpoint.mode", "full"]
ONE_PROCESS = {
    "one process": [],
    "AC full": AC_FULL,
    "accumulation 2": ["--training.local_batch_size", "2", "--training.global_batch_size", "4"],
    "compiled": ["--compile.enable"],
    "compiled, AC full": ["--compile.enable", *AC_FULL],
}
TWO_PROCESSES = {
    "FSDP dp2": ["--training.local_batch_size", "2"],
    "TP2": ["--parallelism.tensor_parallel_degree", "2"],
    "CP2": ["--parallelism.context_parallel_degree", "2"],
    "TP2 compiled": ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.backend", "aot_eager"],
    "PP2 Interleaved1F1B": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                            "Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"],
}
QUANTITIES = (*BLOCK_QUANTITIES, *BRANCH_QUANTITIES)


@pytest.fixture(scope="module")
def prints(tmp_path_factory) -> dict[str, dict]:
    """run name -> {"fingerprints": the lines it wrote, "graph_breaks": ...}."""
    found = {}
    for nproc, runs in ((1, ONE_PROCESS), (2, TWO_PROCESSES)):
        results, _ = run_many(nproc, BASE, runs, tmp_path_factory.mktemp(f"branches-{nproc}"), timeout=900)
        for name, result in results.items():
            lines = [json.loads(line) for line in (Path(result["dump"]) / "fingerprints.jsonl").open()]
            found[name] = {"fingerprints": lines, "graph_breaks": result["graph_breaks"]}
    return found


@pytest.mark.parametrize("name", [name for name in (*ONE_PROCESS, *TWO_PROCESSES) if name != "one process"])
def test_block_figures_agree_with_one_process(name, prints, measured):
    control, test = prints["one process"]["fingerprints"], prints[name]["fingerprints"]
    assert [line["step"] for line in test] == [line["step"] for line in control] == [1, 3]
    worst, where = 0.0, ""
    for a, b in zip(control, test):
        for quantity in QUANTITIES:
            assert a[quantity].keys() == b[quantity].keys() == {"0", "1", "2", "3"}, quantity
            for block, value in a[quantity].items():
                assert value > 0 and b[quantity][block] is not None, (quantity, block)
                difference = abs(b[quantity][block] - value) / value
                if difference > worst:
                    worst, where = difference, f"step {a['step']} {quantity} block {block}"
    measured(f"block fingerprints {name:20s} vs one process: worst relative difference {worst:.1e} ({where})")
    assert worst <= FINGERPRINT_TOLERANCE, where
    assert prints[name]["graph_breaks"] == 0
