"""Every value a plan writes into a script reaches it quoted, or the plan is refused.

A hostile value is put in every field that reaches a script (names, paths, trainer options, the
base config's file name, the seed checkpoint's folder, the [slurm] keys). Control characters are
refused when the plan is loaded, one message per field naming its key. Everything else is written:
the shell script and the SLURM scripts then run under bash with stub commands on PATH (srun, sbatch,
scontrol, and $PYTHON), and no injected command may run, while every argument reaches the stub
exactly as the launch holds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from protocol.plan.load import PlanError, load_plan
from protocol.plan.model import REPO_ROOT, RUN_MARKER, SlurmJob
from protocol.plan.select import LaunchError
from protocol.run.render import render
from protocol.run.sbatch import SUBMIT_ALL, write_slurm

# Each payload runs `touch $INJECTED` (or redirects into it) if it ever reaches bash unquoted; none
# holds a "/", so each can also be part of a file name.
PAYLOADS = [
    "; touch $INJECTED",
    "$(touch $INJECTED)",
    "`touch $INJECTED`",
    "' ; touch $INJECTED ; '",
    '" ; touch $INJECTED ; "',
    "# x ; touch $INJECTED",
    "-x && touch $INJECTED",
    "| touch $INJECTED",
    "> $INJECTED",
    "\\' $(touch $INJECTED) \\",
    "ünïcödé ✓ 名前 $'\\x41'",
    "{a,b} * ? ~ ! %j %%",
]

PLAN = """
[plan]
name = {plan_name}
config = {config}
output = {output}
steps = 3
local_batch_size = 4
dp_degree = 2
gpus_per_node = 2
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32, "job.description" = {value}, "checkpoint.folder" = {folder} }}

[tolerance]
mode = "exact"

[control]
name = {control}
overrides = {{ "job.description" = {control_value} }}

[[sets]]
name = {tp_set}
kind = "parallelism"
tp = 2

[[sets]]
name = {lr_set}
kind = "technique"
overrides = {{ "optimizer.lr" = 6e-3, "job.description" = {value} }}

[[sweeps]]
name = {sweep}
kind = "technique"
grid = {{ "job.description" = [{value}, {other_value}] }}

[[sweeps]]
name = "listed"
kind = "technique"
points = [{{ name = {point}, "job.description" = {value} }}]

[slurm]
srun_options = [{srun_option}, "--export=ALL"]
"""


def toml_string(text: str) -> str:
    """A TOML basic string holding `text` exactly (TOML wants DEL escaped, which JSON leaves)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def hostile_plan(tmp_path: Path, value: str) -> Path:
    """The plan with `value` in every field that reaches a script; its base config is a copy of
    debug_model.toml under a file name holding `value`."""
    config = tmp_path / f"cfg {value}.toml"
    shutil.copy(REPO_ROOT / "train_configs" / "debug_model.toml", config)
    fields = {"plan_name": f"plan {value}", "config": str(config), "output": str(tmp_path / f"out {value}"),
              "value": value, "other_value": f"b {value}", "folder": f"ckpt {value}", "control": f"control {value}",
              "control_value": f"c {value}", "tp_set": f"tp {value}", "lr_set": f"lr {value}", "sweep": f"sw {value}",
              "point": f"p {value}", "srun_option": f"--comment={value}"}
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.format(**{key: toml_string(text) for key, text in fields.items()}))
    return path


STUB = '#!/bin/sh\nprintf \'%s\\0\' "$(basename "$0")" "$#" "$@" >> "$ARGV_LOG"\n'
STUBS = {"srun": STUB, "python": STUB, "sbatch": STUB + "echo 7\n",
         "scontrol": STUB + 'if [ "$1" = show ]; then echo node1; fi\n'}


def stub_env(tmp_path: Path) -> dict[str, str]:
    """PATH with the stubs first; each stub appends its name and argv to $ARGV_LOG."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "SLURM_RESTART_COUNT")}
    return dict(env, PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "python"), ARGV_LOG=str(tmp_path / "argv"),
                INJECTED=str(tmp_path / "INJECTED"), CUDA_VISIBLE_DEVICES="", SLURM_JOB_ID="7", SLURM_NNODES="1",
                SLURM_JOB_NODELIST="node1")


def calls(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(stub name, argv) of every stub call, in order; the log is emptied."""
    log = tmp_path / "argv"
    if not log.exists():
        return []
    fields = log.read_bytes().decode().split("\0")[:-1]
    log.unlink()
    found = []
    while fields:
        name, count, fields = fields[0], int(fields[1]), fields[2:]
        found.append((name, fields[:count]))
        fields = fields[count:]
    return found


def run_script(tmp_path: Path, script: Path) -> None:
    done = subprocess.run(["bash", str(script)], env=stub_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "INJECTED").exists(), f"an injected command ran:\n{script.read_text()}"


@pytest.mark.parametrize("value", PAYLOADS)
def test_the_shell_script_passes_every_value_intact_and_runs_none(tmp_path, value):
    plan = load_plan(hostile_plan(tmp_path, value))
    launches = plan.launches()
    assert any(launch.nodes > 1 for launch in launches)  # written as a comment: the line that broke
    script = tmp_path / "plan.sh"
    script.write_text(render(plan, launches, "shell"))
    run_script(tmp_path, script)

    local = [launch for launch in launches if launch.nodes == 1]
    received = calls(tmp_path)
    assert [name for name, _ in received] == ["python"] * len(local)
    for launch, (_, argv) in zip(local, received):
        assert argv[:2] == ["-m", "trainer.launch"] and argv[-len(launch.args):] == list(launch.args)
        marker = json.loads((launch.output / RUN_MARKER).read_text())
        assert (marker["plan"], marker["run"], marker["command"]) == (plan.name, launch.name, launch.command())
    assert str(plan.seed_checkpoint_path).endswith(f"ckpt {value}/step-0")


@pytest.mark.parametrize("value", PAYLOADS)
def test_the_slurm_scripts_pass_every_value_intact_and_run_none(tmp_path, value):
    plan = load_plan(hostile_plan(tmp_path, value))
    launches = plan.launches()
    out = tmp_path / "slurm"
    paths = write_slurm(plan, launches, out)
    for launch, script in zip(launches, paths):
        run_script(tmp_path, script)
        (name, argv), = [call for call in calls(tmp_path) if call[0] == "srun"]
        assert argv[-len(launch.args):] == list(launch.args)
        assert [f"--comment={value}", "--export=ALL", str(tmp_path / "bin" / "python")] == \
            argv[argv.index(f"--comment={value}"):][:3]
    run_script(tmp_path, out / SUBMIT_ALL)
    submitted = [argv[-1] for name, argv in calls(tmp_path) if name == "sbatch"]
    assert submitted == [path.name for path in paths[:-1]]


def test_a_newline_that_reaches_the_shell_writer_stays_in_its_comment(tmp_path):
    """The loader refuses control characters; the writer does not count on it: a name or an
    argument holding a newline never ends a comment line of the script."""
    plan = load_plan(hostile_plan(tmp_path, "x"))
    payload = "a\ntouch $INJECTED;\n"
    launches = [dataclasses.replace(launch, name=launch.name + payload, search=launch.role == "test",
                                    args=(*launch.args, "--job.description", payload)) if launch.nodes > 1 else launch
                for launch in plan.launches()]
    script = tmp_path / "plan.sh"
    script.write_text(render(plan, launches, "shell"))
    run_script(tmp_path, script)
    assert "touch $INJECTED" not in [line.strip() for line in script.read_text().splitlines()]


def test_the_sbatch_writer_refuses_a_value_it_cannot_quote(tmp_path):
    """#SBATCH lines are read by sbatch, not bash: a control character there cannot be quoted."""
    plan = load_plan(hostile_plan(tmp_path, "x"))
    plan = dataclasses.replace(plan, slurm={"train": SlurmJob(partition="gpu\ntouch $INJECTED")})
    with pytest.raises(LaunchError) as error:
        write_slurm(plan, plan.launches(), tmp_path / "slurm")
    assert "#SBATCH '--partition=gpu\\ntouch $INJECTED' holds a control character (newline)" in str(error.value)
    assert not list((tmp_path / "slurm").glob("*.sbatch"))


# ---------------------------------------------------------------------------------------------
# Control characters: refused at load, one message per field naming its key

CONTROL = {"\n": "newline", "\r": "carriage return", "\x00": "NUL", "\x1b": "U+001B", "\x7f": "U+007F",
           "\x85": "U+0085", "\u2028": "U+2028"}

# (where the value goes, the key the message names, a valid value); the control character goes
# into the middle of the valid value, so that without it the plan would load.
FIELDS = [
    ("plan.name", "plan.name", "small"),
    ("plan.config", "plan.config", "debug_model.toml"),
    ("plan.output", "plan.output", "out"),
    ("control.name", "control.name", "control"),
    ("sets[0].name", "sets[0].name", "FSDP+TP2"),
    ("sets[1].overrides", 'sets[1].overrides."job.description"', "free text"),
    ("plan.overrides", 'plan.overrides."checkpoint.folder"', "checkpoint"),
    ("sweeps[0].name", "sweeps[0].name", "sweep"),
    ("sweeps[0].grid", 'sweeps[0].grid."job.description"[1]', "second"),
    ("sweeps[1].points.name", "sweeps[1].points[0].name", "point"),
    ("sweeps[1].points", 'sweeps[1].points[0]."job.description"', "listed"),
    ("slurm.partition", "slurm.partition", "gpu"),
    ("slurm.account", "slurm.account", "proj"),
    ("slurm.train.qos", "slurm.train.qos", "normal"),
    ("slurm.seed.time", "slurm.seed.time", "1:00:00"),
    ("slurm.seed.mem", "slurm.seed.mem", "64G"),
    ("slurm.extra", "slurm.extra[0]", "--constraint=h100"),
    ("slurm.prologue", "slurm.prologue[1]", "module load cuda"),
    ("slurm.train.srun_options", "slurm.train.srun_options[0]", "--container-image=x"),
]

FIELD_PLAN = """
[plan]
name = {plan.name}
config = {plan.config}
output = {plan.output}
steps = 3
local_batch_size = 4
dp_degree = 2
overrides = {{ "model.flavor" = "tiny", "training.seq_len" = 32, "checkpoint.folder" = {plan.overrides} }}

[tolerance]
mode = "exact"

[control]
name = {control.name}

[[sets]]
name = {sets[0].name}
kind = "parallelism"
tp = 2

[[sets]]
name = "described"
kind = "technique"
overrides = {{ "job.description" = {sets[1].overrides} }}

[[sweeps]]
name = {sweeps[0].name}
kind = "technique"
grid = {{ "job.description" = ["first", {sweeps[0].grid}] }}

[[sweeps]]
name = "listed"
kind = "technique"
points = [{{ name = {sweeps[1].points.name}, "job.description" = {sweeps[1].points} }}]

[slurm]
partition = {slurm.partition}
account = {slurm.account}
extra = [{slurm.extra}]
prologue = ["set -x", {slurm.prologue}]

[slurm.seed]
time = {slurm.seed.time}
mem = {slurm.seed.mem}

[slurm.train]
qos = {slurm.train.qos}
srun_options = [{slurm.train.srun_options}]
"""


def field_plan(tmp_path: Path, hostile: dict[str, str]) -> Path:
    """FIELD_PLAN with the valid values, but those of `hostile` (field -> value)."""
    values = {field: toml_string(hostile.get(field, valid)) for field, _, valid in FIELDS}
    values["plan.output"] = toml_string(str(tmp_path / hostile.get("plan.output", "out")))
    text = FIELD_PLAN
    for field, value in values.items():
        text = text.replace("{" + field + "}", value)
    path = tmp_path / "plan.toml"
    path.write_text(text.replace("{{", "{").replace("}}", "}"))
    return path


def test_the_field_plan_loads_as_written(tmp_path):
    load_plan(field_plan(tmp_path, {}))


@pytest.mark.parametrize("char", CONTROL, ids=CONTROL.values())
def test_a_control_character_in_any_field_is_refused_naming_its_key(tmp_path, char):
    hostile = {field: valid[:2] + char + valid[2:] for field, _, valid in FIELDS}
    with pytest.raises(PlanError) as error:
        load_plan(field_plan(tmp_path, hostile))
    message = str(error.value)
    assert f"{len(FIELDS)} problems:" in message, message
    for field, key, _ in FIELDS:
        value = str(tmp_path / hostile[field]) if field == "plan.output" else hostile[field]
        what = "names may not" if key.endswith("name") else "plan values may not"
        assert f"  - {key}: {value!r} contains a control character ({CONTROL[char]}); {what}" in message, key
    assert len(message.splitlines()) == len(FIELDS) + 1  # a heading, then one line per problem


def test_a_control_character_in_a_key_is_refused_naming_it(tmp_path):
    path = field_plan(tmp_path, {})
    path.write_text(path.read_text().replace('"job.description" = "free', '"job.desc\\nription" = "free'))
    with pytest.raises(PlanError) as error:
        load_plan(path)
    assert "1 problem:" in str(error.value)
    assert "sets[1].overrides: the key 'job.desc\\nription' contains a control character (newline); keys may not" \
        in str(error.value)


def test_a_tab_is_allowed_in_a_prologue_line_only(tmp_path):
    plan = load_plan(field_plan(tmp_path, {"slurm.prologue": "export A=1\t# a tab"}))
    assert plan.slurm["train"].prologue == ("set -x", "export A=1\t# a tab")
    with pytest.raises(PlanError, match=r"sets\[0\].name: 'FS\\tDP' contains a control character \(tab\)"):
        load_plan(field_plan(tmp_path, {"sets[0].name": "FS\tDP"}))


def test_a_prologue_line_continued_by_a_backslash_is_refused(tmp_path):
    with pytest.raises(PlanError) as error:
        load_plan(field_plan(tmp_path, {"slurm.prologue": "module load \\"}))
    assert "slurm.prologue[1]: 'module load \\\\' ends with a backslash, which would join the script's next line " \
           "to it; give each command whole on one line" in str(error.value)


# ---------------------------------------------------------------------------------------------
# #SBATCH lines: sbatch reads them itself, so what it would split or cut there is refused

@pytest.mark.parametrize("key", ["slurm.partition", "slurm.account", "slurm.train.qos"])
@pytest.mark.parametrize("value", ["gpu h100", "gpu'", 'gpu"', "gpu#2", "gpu\\x", "gpu\u00a0x"])
def test_an_sbatch_value_sbatch_would_split_or_cut_is_refused(tmp_path, key, value):
    with pytest.raises(PlanError) as error:
        load_plan(field_plan(tmp_path, {key: value}))
    assert f"1 problem:\n  - {key}: {value!r} would not reach SLURM whole" in str(error.value)


@pytest.mark.parametrize("value", ["--comment=a b", "--comment='a'", "--constraint=h100#x", "--x=\\"])
def test_an_extra_option_sbatch_would_split_or_cut_is_refused(tmp_path, value):
    with pytest.raises(PlanError) as error:
        load_plan(field_plan(tmp_path, {"slurm.extra": value}))
    assert f"1 problem:\n  - slurm.extra: {value!r} would not reach SLURM whole" in str(error.value)


def test_an_extra_item_may_not_hide_an_option_the_protocol_writes(tmp_path):
    with pytest.raises(PlanError) as error:
        load_plan(field_plan(tmp_path, {"slurm.extra": "--constraint h100 --output=/etc/x"}))
    assert "slurm.extra: '--constraint h100 --output=/etc/x' is set by the protocol; remove it" in str(error.value)


@pytest.mark.parametrize("value", ["gpu,gpu-h100", "$(touch x)".replace(" ", ""), "ünï", "-p"])
def test_other_sbatch_values_are_written_as_they_are(tmp_path, value):
    plan = load_plan(field_plan(tmp_path, {"slurm.partition": value, "slurm.extra": "--constraint h100&a100"}))
    write_slurm(plan, plan.launches(), tmp_path / "slurm")
    lines = (tmp_path / "slurm" / "control.sbatch").read_text().splitlines()
    assert f"#SBATCH --partition={value}" in lines and "#SBATCH --constraint h100&a100" in lines


@pytest.mark.parametrize("folder", ["my runs", "it's", 'say "x"', "no#1", "a\\b", "100%"])
def test_a_scripts_folder_sbatch_could_not_take_as_the_log_path_is_refused(tmp_path, folder):
    plan = load_plan(field_plan(tmp_path, {}))
    with pytest.raises(LaunchError) as error:
        write_slurm(plan, plan.launches(), tmp_path / folder)
    assert str(error.value).startswith(f"{tmp_path / folder}: the SLURM scripts' folder holds")
    assert not (tmp_path / folder).exists()


def test_time_and_mem_must_match_whole(tmp_path):
    text = field_plan(tmp_path, {}).read_text()
    path = tmp_path / "plan.toml"
    path.write_text(text.replace('time = "1:00:00"', 'time = "1:00:00\\n"'))
    with pytest.raises(PlanError) as error:
        load_plan(path)
    assert "slurm.seed.time: '1:00:00\\n' contains a control character (newline)" in str(error.value)
