"""The power study in small (benchmarks/protocol_power.py --quick): real bfloat16 runs on the
synthetic_context source judged by the shipped statistical rule. A correct layout (TP 2) passes;
a real parallelism bug injected into the same layout (TP norm-weight gradients not all-reduced)
fails on its gradient norm, and a position bug (each CP rank rotating its chunk from position 0),
which the Markov source could not show, fails on its loss. The fingerprints of the same runs
say where: the bug's norm weights at step 1 or 2, the RoPE bug's query or key projections, and
nothing for the correct layout (benchmarks/fingerprint_localization.py has every bug). The full study, and the rates it
measured, are in docs/protocol_measurements.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import REPO, describe


def test_a_correct_layout_passes_and_an_injected_bug_fails(tmp_path, measured):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "protocol_power.py"), "--quick", "--out",
                             str(tmp_path / "runs"), "--json", str(tmp_path / "power.json")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, describe(result)
    figures = json.loads((tmp_path / "power.json").read_text())
    (experiment,) = figures["verdicts"]
    outcomes = {r["name"]: r for r in experiment["results"]}
    assert outcomes["TP2"]["outcome"] == "PASS", outcomes["TP2"]["reason"]
    bug = outcomes["TP2 norm grad not reduced"]
    assert bug["outcome"] == "FAIL (expected)" and "grad_norm: final-window" in bug["reason"]
    rope = outcomes["CP2 RoPE unshifted"]
    assert rope["outcome"] == "FAIL (expected)" and "loss: final-window" in rope["reason"]
    assert figures["false_fail"] == [0, 1] and figures["false_pass"] == [0, 2]
    where = experiment["fingerprints"]
    assert where["TP2"]["first_step"] is None and where["TP2"]["norm_check"] is None, where["TP2"]["summary"]
    for name, modules in (("TP2 norm grad not reduced", ("norm.weight", "layers.*.ffn_norm.weight",
                                                         "layers.*.attention_norm.weight")),
                          ("CP2 RoPE unshifted", ("layers.*.attention.wq.weight", "layers.*.attention.wk.weight"))):
        assert where[name]["first_step"] in (1, 2), where[name]["summary"]
        assert where[name]["causes"][0]["module"] in modules, where[name]["summary"]
    assert "| TP2 norm grad not reduced | bug" in result.stdout  # the printed table
    measured(f"protocol power (quick): TP2 {outcomes['TP2']['outcome']}, the TP norm-gradient bug {bug['outcome']}, "
             f"the CP RoPE bug {rope['outcome']}; TP2 {outcomes['TP2']['reason'].split(' (TOST')[0]}")
    measured(f"protocol power (quick) fingerprints: TP norm bug {where['TP2 norm grad not reduced']['summary'][:160]}; "
             f"CP RoPE bug {where['CP2 RoPE unshifted']['summary'][:160]}")
