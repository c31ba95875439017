"""The `protocol` command line: formats, exit codes and user errors (no training runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.cli import main
from tests.protocol.conftest import calls

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
    assert [launch["name"] for launch in launches] == ["seed", "1D FSDP", "3D FSDP+TP2+PP2", "4D FSDP+TP2+CP2+PP2",
                                                       "2D FSDP+TP2 compiled", "2D FSDP+CP2", "AC full"]
    assert [launch["nproc"] for launch in launches] == [1, 2, 8, 16, 4, 4, 2]


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
    (["compare", "--control", "x"], "give --control PATH and at least one --test"),
    (["compare", str(SMOKE), "--only", "x", "--control", "c", "--test", "t"], "--only chooses among a plan's sets"),
    (["compare", "--control", "c", "--noise", "n", "--test", "t", "--mode", "exact"], "exact mode compares every step"),
    (["compare", "--control", "c", "--noise", "n", "--test", "t"], "at least 2 --noise"),
    (["compare", "--unpaired", "--control", "c", "--test", "t"], "at least 3 --control"),
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


# ---------------------------------------------------------------------------------------------
# protocol run --compare and protocol compare PLAN, with the fake launcher


@pytest.fixture
def fake_launcher(fake, monkeypatch):
    import protocol.run.local

    monkeypatch.setattr(protocol.run.local, "LAUNCHER", fake[0])


def report_json(plan) -> dict:
    return json.loads((plan.output / "report.json").read_text())


def test_run_compare_reports_a_failed_set_as_a_failed_row(small_plan, fake_launcher, monkeypatch, capsys):
    plan = small_plan(lr=3e-3)  # lr x2 equals the control: it passes
    monkeypatch.setenv("FAKE_FAIL", "fsdp-tp2")
    assert main(["run", str(plan.path), "--compare"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "FAIL: FSDP+TP2"
    data = report_json(plan)
    assert data["passed"] is False
    assert data["not_compared"] == [{"name": "FSDP+TP2", "verdict": "FAILED", "reason": "exit 2"}]
    assert [(r["name"], r["outcome"]) for r in data["results"]] == [("lr x2", "PASS")]
    rows = [line for line in (plan.output / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| lr x2 | dp_shard 2 | 4.97 | 4.91 | 0 | 0 | 0 | PASS |",
                        "| FSDP+TP2 | not recorded (no run_meta.json) | - | - | - | - | - | FAILED |"] + rows[3:]
    assert "- **FSDP+TP2**: FAILED: exit 2" in (plan.output / "report.md").read_text()
    assert "**Overall: FAIL** (1/2 sets as expected)" in (plan.output / "report.md").read_text()


def test_a_failed_control_leaves_nothing_to_compare_against(small_plan, fake_launcher, monkeypatch, capsys):
    plan = small_plan()
    plan.output.mkdir(parents=True)
    (plan.output / "loss.png").write_bytes(b"an earlier report's plot")
    monkeypatch.setenv("FAKE_FAIL", "control")
    assert main(["run", str(plan.path), "--compare"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: nothing to compare against: the control run control FAILED (exit 2)" in out
    data = report_json(plan)
    assert data["results"] == [] and data["passed"] is False
    assert [(m["name"], m["verdict"]) for m in data["not_compared"]] == [("control", "FAILED")]
    assert not (plan.output / "loss.png").exists() and not (plan.output / "grad_norm.png").exists()
    assert "Control: control: nothing to compare against" in (plan.output / "report.md").read_text()


def test_skipped_runs_are_not_run_rows(small_plan, fake_launcher, monkeypatch, capsys):
    plan = small_plan()
    monkeypatch.setenv("FAKE_FAIL", "seed")
    assert main(["run", str(plan.path), "--compare"]) == 1
    data = report_json(plan)
    assert [(m["name"], m["verdict"], m["reason"]) for m in data["not_compared"]] == [
        (name, "NOT RUN", "needs seed, which did not complete") for name in ("control", "FSDP+TP2", "lr x2")]


def test_the_report_describes_each_run_from_its_record_not_the_plan(small_plan, fake_launcher, capsys):
    plan = small_plan(lr=6e-3, steps=3)
    assert main(["run", str(plan.path)]) == 0
    plan = small_plan(lr=3e-3, steps=5)  # edited after the runs, not run again
    capsys.readouterr()
    assert main(["compare", str(plan.path)]) == 1
    out = capsys.readouterr().out  # the console says so too, not only report.md
    assert "note: 3 run(s) differ from the plan as written now" in out
    assert "  lr x2: optimizer.lr 0.006 -> 0.003; training.steps 3 -> 5" in out
    data = report_json(plan)
    assert data["layouts"] == {"FSDP+TP2": "dp_shard 2, tp 2", "lr x2": "dp_shard 2 + optimizer.lr=0.006"}
    runs = data["runs"]
    assert [runs[name]["steps"] for name in ("control", "FSDP+TP2", "lr x2")] == [3, 3, 3]
    assert runs["lr x2"]["differs_from_plan"] == ["optimizer.lr 0.006 -> 0.003", "training.steps 3 -> 5"]
    assert runs["control"]["differs_from_plan"] == ["training.steps 3 -> 5"]
    assert runs["lr x2"]["code"] == "3f2a1c9d" and runs["lr x2"]["status"] == "completed"
    text = (plan.output / "report.md").read_text()
    assert "Code: 3f2a1c9d (every run)" in text
    assert "- **lr x2**: optimizer.lr 0.006 -> 0.003; training.steps 3 -> 5" in text
    assert "| lr x2 | dp_shard 2 + optimizer.lr=0.006 | 3 | completed | 3f2a1c9d | 2.13.0+cpu |" in text


def test_compare_of_a_plan_that_has_not_run(small_plan, capsys):
    plan = small_plan()
    assert main(["compare", str(plan.path)]) == 1
    out = capsys.readouterr().out
    assert f"nothing to compare against: the control run control NOT RUN (no metrics.jsonl in " \
           f"{plan.output / 'control'})" in out


def test_stale_runs_are_refused_with_exit_2(small_plan, fake_launcher, capsys):
    plan = small_plan(lr=6e-3)
    assert main(["run", str(plan.path)]) == 0
    plan = small_plan(lr=3e-3)
    capsys.readouterr()
    assert main(["run", str(plan.path), "--compare"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 1 run in") and "lr x2: optimizer.lr 0.006 -> 0.003" in err
    assert "Traceback" not in err
    assert main(["run", str(plan.path), "--rerun-stale", "--compare"]) == 0
    assert report_json(plan)["layouts"]["lr x2"] == "dp_shard 2"


def test_compare_of_folders_takes_each_layout_from_its_record(small_plan, fake_launcher, tmp_path, capsys):
    plan = small_plan(lr=6e-3)
    assert main(["run", str(plan.path)]) == 0
    other = write_run(tmp_path / "other", [4.97, 4.94, 4.91])  # another trainer's folder: no record
    out = tmp_path / "report"
    assert main(["compare", "--control", str(plan.output / "control"), "--test", f"x={plan.output / 'lr-x2'}",
                 "--test", f"y={other}", "--out", str(out)]) == 1
    layouts = json.loads((out / "report.json").read_text())["layouts"]
    assert layouts == {"x": "dp_shard 2 + optimizer.lr=0.006", "y": ""}


STATISTICAL_PLAN = """
[plan]
name = "stat"
config = "debug_model.toml"
output = "{output}"
steps = 60
local_batch_size = 4
dp_degree = 2
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32, "optimizer.lr" = 3e-3 }}

[tolerance]
mode = "statistical"
noise_controls = 3

[[sets]]
name = "FSDP+TP2"
kind = "parallelism"
tp = 2

[[sets]]
name = "lr x1.05"
kind = "technique"
expect = "fail"
overrides = {{ "optimizer.lr" = {lr} }}
"""


@pytest.mark.parametrize("lr, status, last_line", [
    (3.15e-3, 0, "PASS: every test set trains like the control; positive control lr x1.05 caught"),
    (3e-3, 3, "INCONCLUSIVE: positive control lr x1.05 passed, so this plan could not have caught a bug of that "
              "size (more noise controls, more steps, or a narrower margin)"),
])
def test_a_positive_control_that_passes_makes_the_plan_inconclusive(tmp_path, fake_launcher, monkeypatch, capsys,
                                                                    lr, status, last_line):
    """The lr x1.05 set must fail; when its option equals the control's it cannot, and the plan
    says it could not have caught such a bug (exit 3) instead of PASS."""
    monkeypatch.setenv("FAKE_ROUNDING", "1")
    path = tmp_path / "stat.toml"
    path.write_text(STATISTICAL_PLAN.format(output=tmp_path / "out", lr=lr))
    assert main(["run", str(path), "--compare"]) == status
    assert capsys.readouterr().out.splitlines()[-1] == last_line
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["status"] == ("PASS" if status == 0 else "INCONCLUSIVE") and data["design"] == "paired"
    assert data["controls"] == ["control", "control-noise1", "control-noise2", "control-noise3"]
    outcomes = {r["name"]: r["outcome"] for r in data["results"]}
    assert outcomes == {"FSDP+TP2": "PASS", "lr x1.05": "FAIL (expected)" if status == 0 else "PASS (expected to fail)"}
    # `protocol compare --only` judges the sets named (with the control family) and gives their verdict.
    assert main(["compare", str(path), "--only", "FSDP+TP2", "--out", str(tmp_path / "only")]) == 0
    only = json.loads((tmp_path / "only" / "report.json").read_text())
    assert [r["name"] for r in only["results"]] == ["FSDP+TP2"] and only["status"] == "PASS"
    assert only["warnings"] == ["positive control lr x1.05 not compared (--only): this verdict does not show what "
                                "the plan can catch"]


def test_protocol_run_starts_the_launcher_with_its_own_interpreter(small_plan, fake_launcher, monkeypatch):
    """Without an activated virtualenv and without ./.venv the launcher would fall back to
    python3, which may not have torch: the protocol hands it the interpreter it runs in."""
    import sys

    monkeypatch.delenv("PYTHON", raising=False)
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    plan = small_plan()
    assert main(["run", str(plan.path), "--only", "control"]) == 0
    assert {call["python"] for call in calls(plan.path.parent)} == {sys.executable}


def test_folders_compared_with_a_plans_tolerances_and_refused_when_not_paired(tmp_path, fake_launcher, monkeypatch,
                                                                           capsys):
    """`protocol compare PLAN --control/--noise/--test` judges folders with the plan's statistical
    tolerances and the layouts from the runs' records; a run from another seed checkpoint (another
    plan's) or of another length cannot be paired with the control and is refused, naming why."""
    monkeypatch.setenv("FAKE_ROUNDING", "1")
    path = tmp_path / "stat.toml"
    for output in ("a", "b"):
        path.write_text(STATISTICAL_PLAN.format(output=tmp_path / output, lr=3.15e-3))
        assert main(["run", str(path)]) == 0
    a = tmp_path / "a"
    family = ["--control", str(a / "control"), "--noise", str(a / "control-noise1"), "--noise",
              str(a / "control-noise2")]
    capsys.readouterr()
    assert main(["compare", str(path), *family, "--test", f"tp={a / 'fsdp-tp2'}", "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["mode"] == "statistical" and report["layouts"]["tp"] == "dp_shard 2, tp 2"
    assert report["warnings"] == ["2 noise controls given where the tolerance asks for 3: the noise is measured from "
                                  "fewer or more runs than planned (the report's false-fail chance is that of the runs "
                                  "given)"]
    with pytest.raises(SystemExit):  # which runs a plan makes is not a comparison option
        main(["compare", str(path), "--noise-controls", "2"])
    assert main(["compare", str(path), *family, "--test", f"other={tmp_path / 'b' / 'fsdp-tp2'}"]) == 2
    error = capsys.readouterr().err
    assert "cannot be compared with the control 'control'" in error and "other: seed checkpoint " in error
    path.write_text(STATISTICAL_PLAN.format(output=tmp_path / "c", lr=3.15e-3).replace("steps = 60", "steps = 50"))
    assert main(["run", str(path), "--only", "FSDP+TP2"]) == 0
    capsys.readouterr()
    assert main(["compare", str(path), *family, "--test", f"short={tmp_path / 'c' / 'fsdp-tp2'}"]) == 2
    assert "short: seed checkpoint" in (error := capsys.readouterr().err) and "steps 50, the control's 60" in error


def test_exact_mode_warns_about_runs_that_are_not_deterministic_fp32(small_plan, fake_launcher, capsys):
    plan = small_plan(lr=3e-3)  # the small plan leaves debug.deterministic off
    assert main(["run", str(plan.path), "--compare"]) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning: "))
    assert warning.startswith("warning: exact mode expects deterministic float32 runs, but control (float32, not "
                              "deterministic), FSDP+TP2 (float32, not deterministic)")
    assert "Warning: exact mode expects deterministic float32 runs" in (plan.output / "report.md").read_text()
    assert report_json(plan)["warnings"] == [warning.removeprefix("warning: ")]


def test_unpaired_curves_are_judged_against_the_spread_of_seed_repeats(tmp_path, capsys):
    """Another trainer's seed repeats trained on other data: no pairing is possible, the report says
    so, and the same rule judges the test against the repeats' spread."""
    import numpy as np

    rng = np.random.default_rng(0)
    steps = np.arange(1, 201)

    def repeat(name: str, offset: float = 0.0) -> Path:
        loss = 2.5 + 3.0 * np.exp(-steps / 40) + rng.normal(0, 0.01) + rng.normal(0, 0.02, len(steps)) + offset
        return write_run(tmp_path / name, [float(v) for v in loss])

    controls = [arg for i in range(4) for arg in ("--control", str(repeat(f"seed{i}")))]
    out = tmp_path / "report"
    assert main(["compare", "--unpaired", *controls, "--test", f"other={repeat('other')}", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Convergence report: statistical mode, UNPAIRED") and "UNPAIRED (--unpaired)" in text
    assert "control repeats: seed1, seed2, seed3" in text
    assert main(["compare", "--unpaired", *controls, "--test", f"off={repeat('off', 0.2)}", "--out", str(out)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL: off"
