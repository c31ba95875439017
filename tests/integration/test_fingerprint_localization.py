"""The localization study in small (benchmarks/fingerprint_localization.py, float32, exact mode):
real runs through the protocol's own runner, bugs injected by benchmarks/faults. One TP rank
doubling the gradient of block 2's feed_forward.w2 is named with its block at step 1; FSDP
averaging instead of summing is named as every parameter's gradient, halved. Correct layouts
raise no alarm: the parity matrix (tests/integration/test_parallel_parity.py), cpu_smoke end to
end and the power study's TP 2 (tests/integration/test_protocol_power.py) check it. Every bug, in
bfloat16 too, with the table: docs/protocol_measurements.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import REPO, describe

CASES = ("TP2 w2 grad doubled in block 2", "FSDP grads averaged (under TP2)")


def test_each_bug_is_named_where_it_is(tmp_path, measured):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fingerprint_localization.py"), "--dtypes",
                             "float32", "--steps", "2", "--cases", ",".join(CASES), "--out", str(tmp_path / "runs"),
                             "--json", str(tmp_path / "rows.json")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, describe(result)
    rows = {row[0]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["TP2 w2 grad doubled in block 2"][3:6] == [
        "1", "layers.*.feed_forward.w2.weight grad_norm (block 2)", "yes"], rows["TP2 w2 grad doubled in block 2"]
    assert rows["FSDP grads averaged (under TP2)"][3:6] == ["1", "every parameter grad_norm", "yes"]
    assert "every parameter gradient norm off by -50.0%" in rows["FSDP grads averaged (under TP2)"][6]
    assert "2 of 2 right" in result.stdout
    measured(f"fingerprint localization (float32, 2 steps): {rows['TP2 w2 grad doubled in block 2'][6][:150]}")
