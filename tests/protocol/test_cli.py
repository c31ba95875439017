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
    assert [launch["name"] for launch in launches] == ["seed", "1D FSDP", "3D FSDP+TP2+PP2", "4D FSDP+TP2+CP2+PP2", "2D FSDP+CP2", "AC full"]
    assert [launch["nproc"] for launch in launches] == [1, 2, 8, 16, 4, 2]


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


def test_compare_out_that_is_a_file_is_one_clear_error(tmp_path, capsys):
    control = write_run(tmp_path / "control", [5.0, 4.9])
    saved = tmp_path / "notes.txt"
    saved.write_text("keep me")
    assert main(["compare", "--control", str(control), "--test", f"same={control}", "--out", str(saved)]) == 2
    assert f"--out {saved}: exists and is not a folder" in capsys.readouterr().err
    assert saved.read_text() == "keep me"


def test_plan_out_is_only_for_slurm_scripts(tmp_path, capsys):
    assert main(["plan", str(SMOKE), "--format", "shell", "--out", str(tmp_path / "x")]) == 2
    assert "--out is the folder of --format slurm's scripts" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_slurm_scripts_into_a_folder_that_cannot_be_created(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["plan", str(SMOKE), "--format", "slurm", "--out", str(tmp_path / "file" / "scripts")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot create the folder" in err and "Traceback" not in err


def test_slurm_launcher_needs_sbatch_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(SMOKE), "--launcher", "slurm"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_interrupt_exits_130_without_a_traceback(monkeypatch, capsys):
    import protocol.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_plan", interrupted)
    assert main(["plan", str(SMOKE)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_closed_output_pipe_ends_quietly():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    # `protocol plan ... | head`: the reader has gone before the table is written.
    process = subprocess.Popen([sys.executable, "-m", "protocol", "plan", str(SMOKE)], cwd=root,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
