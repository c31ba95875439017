"""A float16 statistical plan on CPU: every run's loss scaler skips steps for an overflow, and a
correct set whose scale grows on another clock skips other steps than the control family. The
steps any run skipped are left out for every run, the skip counts are reported, and the plan
passes (before, the out-of-phase set failed on 'grad_norm: not finite at step X')."""

from __future__ import annotations

import json

import pytest

from tests.protocol.test_end_to_end import explain, protocol

# A real plan of 2-process runs.
pytestmark = pytest.mark.slow

PLAN = """
[plan]
name = "float16_skips"
config = "debug_model.toml"
output = "{output}"
steps = 40
warmup_steps = 4
local_batch_size = 4
dp_degree = 1
batch = "local"
seed_checkpoint = true
seed = 0

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 32
"training.mixed_precision_param" = "float16"
"training.loss_scale_initial" = 1048576.0
"training.loss_scale_growth_interval" = 4
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"debug.deterministic" = true

[tolerance]
mode = "statistical"
noise_controls = 2

[control]
name = "FSDP 1"

[[sets]]
name = "TP 2"
kind = "parallelism"
tp = 2

[[sets]]
name = "TP 2, scale grows every 5"
kind = "parallelism"
tp = 2
overrides = {{ "training.loss_scale_growth_interval" = 5 }}
"""


def skipped(folder) -> list[int]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if r.get("step_skipped")]


def test_steps_skipped_out_of_phase_pass_and_are_counted(tmp_path, measured):
    plan = tmp_path / "plan.toml"
    out = tmp_path / "runs"
    plan.write_text(PLAN.format(output=out))
    result = protocol("run", str(plan), "--compare", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    family, in_phase, other = skipped(out / "fsdp-1"), skipped(out / "tp-2"), skipped(out / "tp-2-scale-grows-every-5")
    assert family and in_phase == family and set(other) != set(family), (family, other)  # out of phase
    report = json.loads((out / "report.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert all(r["outcome"] == "PASS" for r in results.values()), report["results"]
    assert results["TP 2, scale grows every 5"]["skipped_steps"] == len(other)
    assert report["family_skips"]["FSDP 1"] == len(family)
    # each set is compared on the steps neither it nor any member of the family skipped
    assert [o["steps"] for o in results["TP 2"]["observables"]] == [40 - len(family)] * 2
    assert [o["steps"] for o in results["TP 2, scale grows every 5"]["observables"]] == \
        [40 - len(set(family) | set(other))] * 2
    assert "float16 steps skipped for an overflow" in (out / "report.md").read_text()
    measured(f"float16 plan: the family skipped {family}, the out-of-phase set {other}; both sets PASS")
