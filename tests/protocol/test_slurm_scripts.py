"""What a cluster user sets in a plan's [slurm] tables and finds in the sbatch scripts: options per
kind of job, a prologue and srun options, CPU or GPU nodes, the rendezvous port, the save before
the time limit with the job's own requeue, and scripts edited by hand that are never overwritten."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from protocol.plan.load import PlanError, load_plan
from protocol.plan.select import LaunchError
from protocol.run.sbatch import write_slurm

CLUSTER = """
[slurm]
account = "proj"
prologue = ["module load cuda/12.4", "source /shared/venv/bin/activate"]

[slurm.seed]
partition = "cpu"
mem = "16G"

[slurm.train]
partition = "gpu"
exclusive = true
srun_options = ["--container-image=/shared/torch.sqsh", "--container-mounts=/shared"]
prologue = ["export NCCL_DEBUG=WARN"]
rdzv_port = 29611
save_before_limit = 300
max_requeues = 4
time = "4:00:00"
"""


def scripts(small_plan, tmp_path: Path, slurm: str) -> dict[str, list[str]]:
    plan = small_plan()
    plan.path.write_text(plan.path.read_text() + slurm)
    plan = load_plan(plan.path)
    write_slurm(plan, plan.launches(), tmp_path / "slurm")
    return {name: (tmp_path / "slurm" / f"{name}.sbatch").read_text().splitlines() for name in ("seed", "control")}


def sbatch_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("#SBATCH")]


def test_a_gpu_cluster_script_per_kind_of_job(small_plan, tmp_path):
    found = scripts(small_plan, tmp_path, CLUSTER)
    control = found["control"]
    assert sbatch_lines(control)[2:] == [
        "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
        f"#SBATCH --output={tmp_path / 'slurm' / 'control-%j.log'}", "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
        "#SBATCH --time=4:00:00", "#SBATCH --exclusive"]
    # The prologue runs in the checkout, before the interpreter is chosen ([slurm]'s lines first).
    cd = next(i for i, line in enumerate(control) if line.startswith("cd "))
    assert control[cd + 1:cd + 4] == ["module load cuda/12.4", "source /shared/venv/bin/activate",
                                      "export NCCL_DEBUG=WARN"]
    assert control[cd + 4].startswith("export PYTHONPATH=")
    srun = next(line for line in control if line.startswith("srun "))
    assert srun.startswith('srun --kill-on-bad-exit=1 --container-image=/shared/torch.sqsh --container-mounts=/shared '
                           '"$PYTHON" -m trainer.launch --nproc 2 --device cuda --nnodes "$SLURM_NNODES" '
                           '--rdzv-endpoint "$head:29611" ')
    assert "scontrol requeue" in "\n".join(control) and '"${SLURM_RESTART_COUNT:-0}" -lt 4' in "\n".join(control)

    seed = found["seed"]
    assert sbatch_lines(seed)[2:] == ["#SBATCH --ntasks=1", f"#SBATCH --output={tmp_path / 'slurm' / 'seed-%j.log'}",
                                      "#SBATCH --open-mode=append", "#SBATCH --partition=cpu",
                                      "#SBATCH --account=proj", "#SBATCH --mem=16G"]
    assert "module load cuda/12.4" in seed and "export NCCL_DEBUG=WARN" not in seed
    assert not any("requeue" in line or "--gpus" in line for line in seed)


def test_cpu_nodes_get_a_cpu_per_process_unless_the_plan_says_how_many(small_plan, tmp_path):
    control = scripts(small_plan, tmp_path, '[slurm.train]\ndevice = "cpu"\n')["control"]
    assert "#SBATCH --cpus-per-task=2" in control and not any("gpu" in line for line in control)
    assert "--device cpu" in next(line for line in control if line.startswith("srun "))
    control = scripts(small_plan, tmp_path, '[slurm.train]\ndevice = "cpu"\ncpus_per_task = 16\n')["control"]
    assert [line for line in sbatch_lines(control) if "cpus-per-task" in line] == ["#SBATCH --cpus-per-task=16"]


def test_without_a_save_before_the_limit_there_is_no_signal_and_no_requeue(small_plan, tmp_path):
    control = sbatch_lines(scripts(small_plan, tmp_path, "[slurm.train]\nsave_before_limit = 0\n")["control"])
    assert not any("--signal" in line or "--requeue" in line for line in control)


def test_the_signal_is_the_one_the_runs_save_on(small_plan, tmp_path):
    plan = small_plan()
    plan.path.write_text(plan.path.read_text().replace('"optimizer.lr" = 3e-3', '"optimizer.lr" = 3e-3, '
                                                       '"checkpoint.save_on_signal" = "SIGUSR2"'))
    plan = load_plan(plan.path)
    write_slurm(plan, plan.launches(), tmp_path / "slurm")
    assert "#SBATCH --signal=USR2@120" in (tmp_path / "slurm" / "control.sbatch").read_text().splitlines()


@pytest.mark.parametrize("slurm, message", [
    ('[slurm.seed]\ndevice = "cpu"\n', "slurm.seed.device: only training jobs have it"),
    ('[slurm]\ndevice = "tpu"\n', "slurm.device: 'tpu' is not one of 'cuda', 'cpu'"),
    ("[slurm.train]\nrdzv_port = 70000\n", "slurm.train.rdzv_port: 70000 is not a port (1-65535)"),
    ("[slurm]\nsave_before_limit = -5\n", "slurm.save_before_limit: must be >= 0, got -5"),
    ('[slurm.train]\nextra = ["--requeue"]\n', "slurm.train.extra: '--requeue' is set by the protocol"),
    ('[slurm]\nprologue = "module load cuda"\n', "slurm.prologue: expected"),
])
def test_cluster_settings_a_job_cannot_have_are_refused_with_the_key(small_plan, tmp_path, slurm, message):
    plan = small_plan()
    plan.path.write_text(plan.path.read_text() + slurm)
    with pytest.raises(PlanError) as error:
        load_plan(plan.path)
    assert message in str(error.value)


FAKE_SRUN = '#!/usr/bin/env bash\necho "srun cpus=${SRUN_CPUS_PER_TASK:-unset}"\nexit "$SRUN_EXIT"\n'
FAKE_SCONTROL = ('#!/usr/bin/env bash\nif [ "$1" = show ]; then echo node1; exit 0; fi\n'
                 'echo "scontrol $*" >> "$SCONTROL_LOG"\n')


def run_job(tmp_path: Path, script: Path, srun_exit: int, restarts: int) -> subprocess.CompletedProcess:
    """The control's script with a fake srun that exits `srun_exit`, as the `restarts`-th requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_EXIT=str(srun_exit),
               SCONTROL_LOG=str(tmp_path / "scontrol.log"), SLURM_JOB_ID="42", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="node1", SLURM_CPUS_PER_TASK="8", SLURM_RESTART_COUNT=str(restarts))
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_a_run_that_saved_before_its_time_limit_requeues_its_job_until_max_requeues(small_plan, tmp_path):
    scripts(small_plan, tmp_path, "[slurm.train]\nmax_requeues = 2\n")
    script = tmp_path / "slurm" / "control.sbatch"
    saved = run_job(tmp_path, script, 75, restarts=1)
    assert saved.returncode == 0, saved.stderr
    assert "srun cpus=8" in saved.stdout  # the job's CPUs reach the launcher's step
    assert "job 42 requeued to resume from it (requeue 2 of 2)" in saved.stdout
    assert (tmp_path / "scontrol.log").read_text() == "scontrol requeue 42\n"
    last = run_job(tmp_path, script, 75, restarts=2)
    assert last.returncode == 75 and "after 2 requeues (max_requeues); run protocol run again" in last.stdout
    failed = run_job(tmp_path, script, 1, restarts=0)
    assert failed.returncode == 1
    assert (tmp_path / "scontrol.log").read_text() == "scontrol requeue 42\n"  # no requeue but after a save


def test_a_script_edited_by_hand_is_kept_or_refused_never_overwritten(small_plan, tmp_path):
    plan = small_plan()
    out = tmp_path / "slurm"
    write_slurm(plan, plan.launches(), out)
    control = out / "control.sbatch"
    edited = control.read_text().replace("set -euo pipefail", "set -euo pipefail\nmodule load my-site-python")
    control.write_text(edited)

    notes: list[str] = []
    write_slurm(plan, plan.launches(), out, notes.append)  # the plan's script is unchanged: the edit stays
    assert control.read_text() == edited
    assert notes == [f"{control}: edited by hand, kept (the plan's script is the one it was made from)"]

    plan = small_plan(steps=5)  # the plan changes: the edited script is refused, the new one lands beside it
    with pytest.raises(LaunchError) as error:
        write_slurm(plan, plan.launches(), out)
    assert str(error.value).startswith(f"{control} was edited by hand, and the plan now writes another script")
    assert control.read_text() == edited
    assert "--training.steps 5" in (out / "control.sbatch.new").read_text()
    seed_before = (out / "seed.sbatch").read_text()
    assert "--training.steps 5" in (out / "fsdp-tp2.sbatch").read_text()  # unedited scripts follow the plan
    assert (out / "seed.sbatch").read_text() == seed_before

    control.unlink()  # the user takes the new script
    write_slurm(plan, plan.launches(), out)
    assert "--training.steps 5" in control.read_text() and not (out / "control.sbatch.new").exists()
