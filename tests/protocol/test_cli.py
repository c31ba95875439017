"""The `protocol` command line: formats, exit codes and user errors (no training runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "protocol" / "plans" / "cpu_smoke.toml"


def write_run(folder: Path, losses: list[float]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": loss, "grad_norm": 1.0}) for i, loss in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_plan_prints_launches_as_json_in_order(capsys):
    assert main(["plan", str(SMOKE), "--format", "json"]) == 0
    launches = json.loads(capsys.readouterr().out)
    assert [launch["name"] for launch in launches] == ["seed", "1D FSDP", "3D FSDP+TP2+PP2", "2D FSDP+CP2", "AC full"]
    assert [launch["nproc"] for launch in launches] == [1, 2, 8, 4, 2]


def test_slurm_format_needs_an_output_folder(capsys):
    assert main(["plan", str(SMOKE), "--format", "slurm"]) == 2
    assert "--out DIR" in capsys.readouterr().err


def test_missing_plan_file_is_one_clear_error(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml: no such plan file" in capsys.readouterr().err


def test_compare_folders_passes_within_tolerance_and_fails_outside(tmp_path, capsys):
    control = write_run(tmp_path / "control", [5.0, 4.9, 4.8, 4.7])
    close = write_run(tmp_path / "close", [5.0, 4.9 + 2e-5, 4.8, 4.7 - 3e-5])
    far = write_run(tmp_path / "far", [5.0, 4.9, 4.81, 4.72])
    out = tmp_path / "report"

    assert main(["compare", "--control", str(control), "--test", f"close={close}", "--out", str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["compare", "--control", str(control), "--test", f"close={close}", "--test", f"far={far}",
                 "--out", str(out)]) == 1
    assert "FAIL: far" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert {r["name"]: r["first_diverging_step"] for r in report["results"]} == {"close": None, "far": 3}
    # A looser tolerance from the command line changes the verdict.
    assert main(["compare", "--control", str(control), "--test", f"far={far}", "--loss-atol", "0.05",
                 "--out", str(out)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["compare"], "needs a plan, or --control PATH"),
    (["compare", "--control", "x"], "needs a plan, or --control PATH"),
    (["compare", str(SMOKE), "--control", "x", "--test", "y"], "not both"),
    (["compare", "--control", "c", "--test", "t", "--loss-atol", "-1"], "tolerance.loss_atol: must be > 0"),
])
def test_compare_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_compare_of_a_missing_run_names_the_folder(tmp_path, capsys):
    control = write_run(tmp_path / "control", [5.0, 4.9])
    assert main(["compare", "--control", str(control), "--test", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
