"""Checkpoints: seed checkpoints, exact resume after SIGKILL or a stop signal, resharding, retention, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launch import LAUNCHER, REPO, TINY_JOB, descendants, describe, launch, read_metrics, run_many
from tests.ranks import start_ranks
from tests.warm_python import REAL_PROCESSES
from tests.warm_python.server import ORDER_INDEPENDENT
from trainer.launch.stop_request import catches


def listing(folder) -> list[str]:
    """The names in a checkpoint folder, without its lock: a run's lock is removed when the run
    ends, but one killed (SIGKILL) leaves it, for the next start to take over."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


JOB = [*TINY_JOB, "--training.steps", "20", "--lr_scheduler.warmup_steps", "4"]


def model_tensors(checkpoint, tmp_path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    return torch.load(out, weights_only=False)["model"]


def losses_by_step(dump) -> dict[int, float]:
    """Last logged loss of each step (a resumed run appends to metrics.jsonl)."""
    return {r["step"]: r["loss"] for r in read_metrics(dump) if "kind" not in r}


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A seed checkpoint of debug.seed 7 (the runs below use seed 0), made by asking for 4 processes."""
    dump = tmp_path_factory.mktemp("seed")
    result = launch(4, [*TINY_JOB, "--debug.seed", "7", "--job.dump_folder", str(dump),
                        "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 0, describe(result)
    assert "seed checkpoint of tiny (229952 parameters, seed 7)" in result.stdout
    return dump / "checkpoint" / "step-0"


def test_seed_checkpoint_refuses_several_processes(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "trainer.train",
         *TINY_JOB, "--job.dump_folder", str(tmp_path), "--checkpoint.create_seed_checkpoint"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode != 0
    assert "runs as ONE process, but 2 were started" in result.stderr  # torchrun prints the rank's report
    assert not (tmp_path / "checkpoint").exists()


def test_seed_checkpoint_is_never_overwritten(seed):
    before = (seed / "__0_0.distcp").read_bytes()
    result = launch(1, [*TINY_JOB, "--job.dump_folder", str(seed.parent.parent), "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 2 and "exists already; refusing to overwrite it" in result.stderr
    assert (seed / "__0_0.distcp").read_bytes() == before


def test_seed_loads_bitwise_into_any_layout(seed, tmp_path):
    """lr 0 keeps the loaded weights; the last (model-only) save then shows exactly what was loaded."""
    seed_tensors = model_tensors(seed, tmp_path)
    losses = {}
    for nproc, local in ((1, 8), (2, 4)):
        dump = tmp_path / f"fsdp{nproc}"
        result = launch(nproc, [*TINY_JOB, "--training.steps", "1", "--optimizer.lr", "0", "--training.local_batch_size",
                                str(local), "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
                                "--job.dump_folder", str(dump)])
        assert result.returncode == 0, describe(result)
        loaded = model_tensors(dump / "checkpoint" / "step-1", tmp_path)
        assert loaded.keys() == seed_tensors.keys()
        assert all(torch.equal(loaded[k], seed_tensors[k]) for k in seed_tensors), f"{nproc} processes"
        losses[nproc] = read_metrics(dump)[0]["loss"]
    print(f"step-1 loss from the seed: 1 process {losses[1]:.8f}, 2 processes {losses[2]:.8f}")
    assert abs(losses[1] - losses[2]) <= 1e-6


def test_load_only_never_writes_next_to_the_seed(seed, tmp_path):
    result = launch(2, [*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "4",
                        "--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.interval", "1",
                        "--checkpoint.initial_load_path", str(seed), "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert f"loaded model from {seed}" in result.stdout
    assert not (tmp_path / "checkpoint").exists()
    assert listing(seed.parent) == ["step-0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dump = tmp_path_factory.mktemp("uninterrupted")
    result = launch(2, [*JOB, "--training.local_batch_size", "4", "--job.dump_folder", str(dump)])
    assert result.returncode == 0, describe(result)
    return losses_by_step(dump)


def head_step(folder) -> int | None:
    """The step lineage.json names (None before it is written)."""
    try:
        return json.loads((folder / "lineage.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def kill_after_checkpoint(args, dump, step: int, nproc: int = 2) -> None:
    """Start a run and SIGKILL all its processes as soon as the checkpoint of `step` is published."""
    # Real processes: the ranks are found below the launcher.
    env = dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **REAL_PROCESSES)
    proc = subprocess.Popen([str(LAUNCHER), *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    published = dump / "checkpoint" / f"step-{step}"
    deadline = time.time() + 240
    while not published.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)  # the log reaches us late; the folder appears the moment it is renamed
    # Publishing ends with the folder's lineage head naming the step (written right after the rename).
    while head_step(dump / "checkpoint") != step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers live in their own groups
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


RESUMABLE = [*JOB, "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "10"]


@pytest.fixture(scope="module")
def killed_at_10(tmp_path_factory):
    """A 2-process run of the 20-step job, SIGKILLed right after publishing its step-10 checkpoint."""
    dump = tmp_path_factory.mktemp("killed")
    kill_after_checkpoint([*RESUMABLE, "--job.dump_folder", str(dump)], dump, 10)
    assert (dump / "checkpoint" / "step-10" / ".metadata").is_file()
    time.sleep(3)  # a surviving worker would go on to write later checkpoints
    assert listing(dump / "checkpoint") == ["lineage.json", "step-10"]
    return dump


def test_exact_resume_after_sigkill(tmp_path, killed_at_10, uninterrupted):
    shutil.copytree(killed_at_10, tmp_path, dirs_exist_ok=True)
    result = launch(2, [*RESUMABLE, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in result.stdout
    resumed = losses_by_step(tmp_path)
    diffs = [abs(resumed[s] - uninterrupted[s]) for s in range(11, 21)]
    print(f"resume after SIGKILL at step 10: largest |loss diff| over steps 11-20 = {max(diffs):.3e}")
    assert max(diffs) == 0.0


# Warmup covers every step: the learning rate of step s is then the same for 4, 6 or 20 total
# steps, so an extended run can equal a run configured with the larger count from the start.
EXTENDABLE = [*TINY_JOB, "--lr_scheduler.warmup_steps", "10", "--training.local_batch_size", "4"]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    dump = tmp_path_factory.mktemp("six-steps")
    result = launch(2, [*EXTENDABLE, "--training.steps", "6", "--job.dump_folder", str(dump)])
    assert result.returncode == 0, describe(result)
    return losses_by_step(dump)


@pytest.mark.parametrize("name, options", [
    ("defaults", []),  # interval 500, last_save_model_only: only the last save exists
    ("keep_latest_k 1, interval 3", ["--checkpoint.keep_latest_k", "1", "--checkpoint.interval", "3"]),
])
def test_raising_steps_continues_a_finished_run(tmp_path, six_steps, name, options, measured):
    args = [*EXTENDABLE, "--checkpoint.enable", *options, "--job.dump_folder", str(tmp_path),
            "--metrics.enable_tensorboard"]
    first = launch(2, [*args, "--training.steps", "4"])
    assert first.returncode == 0, describe(first)
    again = launch(2, [*args, "--training.steps", "4"])
    assert again.returncode == 0 and "nothing to do. Raise training.steps to continue" in again.stdout
    extended = launch(2, [*args, "--training.steps", "6"])
    assert extended.returncode == 0, describe(extended)
    assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in extended.stdout
    assert "(step 4)" in extended.stdout

    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once
    losses = losses_by_step(tmp_path)
    diff = max(abs(losses[s] - six_steps[s]) for s in six_steps)
    measured(f"4 steps raised to 6 ({name}): max |loss diff| against a 6-step run {diff:.1e}")
    assert losses == six_steps  # bitwise: the same run
    saved = listing(tmp_path / "checkpoint")
    assert saved == ["lineage.json", *(["step-4", "step-6"] if not options else ["step-6"])]
    record = json.loads((tmp_path / "run_meta.json").read_text())
    assert (record["status"], record["last_step"], record["start"]["kind"], record["start"]["step"]) == (
        "completed", 6, "resume", 4)
    assert [(r["status"], r["last_step"]) for r in record["history"]] == [("completed", 4)]
    assert len(list((tmp_path / "tb").iterdir())) == 1  # one run, one TensorBoard folder


def test_a_checkpoint_folder_that_cannot_be_continued_stops_the_run(tmp_path, seed):
    """A model-only step-N (the last save of earlier versions) has no optimizer or data state."""
    shutil.copytree(seed, tmp_path / "checkpoint" / "step-4")
    result = launch(2, [*EXTENDABLE, "--training.steps", "6", "--checkpoint.enable", "--job.dump_folder",
                        str(tmp_path)])
    assert result.returncode == 2, describe(result)
    output = result.stdout + result.stderr
    assert "holds the model weights only" in output and "--checkpoint.initial_load_path" in output
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before training, never from random weights


def test_resume_after_a_crash_keeps_each_step_once(tmp_path, killed_at_10):
    """The killed run logged steps past its last checkpoint; they are trained again, logged once."""
    shutil.copytree(killed_at_10, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # as if it had logged step 11 before the kill
        f.write(json.dumps({"step": 11, "loss": 1.0}) + "\n")
    result = launch(2, [*RESUMABLE, "--training.steps", "12", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == list(range(1, 13))
    moved = list((tmp_path / "previous").glob("*-after-step-10/metrics.jsonl"))
    assert len(moved) == 1
    assert {"step": 11, "loss": 1.0} in [json.loads(line) for line in moved[0].read_text().splitlines()]  # kept


# Loaded by every process of a run through PYTHONPATH: its ranks SIGKILL themselves when they reach
# the save of step KILL_AT_SAVE, once the previous (asynchronous) save has written its .metadata,
# which DCP writes last. They wait up to 5 s more for that save to be published, which takes
# milliseconds when saves are published on completion, so the kill always falls between two saves.
KILL_HOOK = ORDER_INDEPENDENT + """
import os

if "RANK" in os.environ and "KILL_AT_SAVE" in os.environ:
    import signal
    import time

    import trainer.checkpoint.manager

    save = trainer.checkpoint.manager.CheckpointManager.save

    def save_or_die(self, step, **kwargs):
        if step == int(os.environ["KILL_AT_SAVE"]):
            written = [self.folder / f".step-{self.last_saved}.partial", self.folder / f"step-{self.last_saved}"]
            deadline = time.time() + 60
            while not any((p / ".metadata").is_file() for p in written) and time.time() < deadline:
                time.sleep(0.01)
            deadline = time.time() + 5
            while not written[1].exists() and time.time() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return save(self, step, **kwargs)

    trainer.checkpoint.manager.CheckpointManager.save = save_or_die
"""

ASYNC_RESUMABLE = [*JOB, "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "3",
                   "--checkpoint.async_mode", "async"]


@pytest.fixture(scope="module")
def async_killed_at_6(tmp_path_factory):
    """A 2-process run with asynchronous saves every 3 steps, SIGKILLed after its step-3 save
    was written, at the start of its step-6 save."""
    dump, hook = tmp_path_factory.mktemp("async-killed"), tmp_path_factory.mktemp("kill-hook")
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "KILL_AT_SAVE", "MAX_RESTARTS")}
    # No automatic restart: the test restarts it by hand, as after the death of the whole job.
    os.environ.update(PYTHONPATH=str(hook), KILL_AT_SAVE="6", MAX_RESTARTS="0")
    try:
        result = launch(2, [*ASYNC_RESUMABLE, "--job.dump_folder", str(dump)])
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    assert result.returncode == 128 + signal.SIGKILL, describe(result)
    assert max(r["step"] for r in read_metrics(dump)) == 6
    return dump


def test_async_checkpoint_survives_a_crash(tmp_path, async_killed_at_6, uninterrupted):
    """The step-3 save was published as soon as it was written: the restart resumes from it."""
    checkpoints = async_killed_at_6 / "checkpoint"
    assert listing(checkpoints) == ["lineage.json", "step-3"]  # not left as .step-3.partial
    assert json.loads((checkpoints / "step-3" / "checkpoint.json").read_text())["step"] == 3
    shutil.copytree(async_killed_at_6, tmp_path, dirs_exist_ok=True)
    result = launch(2, [*ASYNC_RESUMABLE, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in result.stdout
    assert "(step 3)" in result.stdout
    assert json.loads((tmp_path / "run_meta.json").read_text())["start"]["step"] == 3
    resumed = losses_by_step(tmp_path)
    assert [resumed[s] for s in range(4, 21)] == [uninterrupted[s] for s in range(4, 21)]  # bitwise


def test_restart_publishes_a_finished_partial_save_and_removes_an_unfinished_one(tmp_path, async_killed_at_6,
                                                                                  uninterrupted):
    """A crash between DCP's .metadata and the rename leaves a finished .step-N.partial: it is
    published (with a checkpoint.json, even when an earlier version wrote none); a partial
    without .metadata was cut off while writing and is removed."""
    shutil.copytree(async_killed_at_6, tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "checkpoint"
    [saved] = checkpoints.glob("*step-3*")  # step-3, or .step-3.partial where saves are published late
    if saved.name == "step-3":
        saved.rename(checkpoints / ".step-3.partial")
    (checkpoints / ".step-3.partial" / "checkpoint.json").unlink(missing_ok=True)  # as an earlier version left it
    shutil.copytree(checkpoints / ".step-3.partial", checkpoints / ".step-6.partial")
    (checkpoints / ".step-6.partial" / ".metadata").unlink()
    # Step 4's loss depends only on the state after step 3, so 4 steps here equal 20 there.
    result = launch(2, [*ASYNC_RESUMABLE, "--training.steps", "4", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert f"publishing {checkpoints / '.step-3.partial'}: its save had completed" in result.stdout
    assert f"removing {checkpoints / '.step-6.partial'}: a save that never completed" in result.stdout
    assert "(step 3)" in result.stdout
    assert losses_by_step(tmp_path)[4] == uninterrupted[4]
    assert listing(checkpoints) == ["lineage.json", "step-3", "step-4"]
    record = json.loads((checkpoints / "step-3" / "checkpoint.json").read_text())
    assert (record["step"], record["published_at_restart"]) == (3, True)


INTERLEAVED_PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                   "Interleaved1F1B")


# name -> (processes, local batch, layout)
OTHER_LAYOUTS = {"1 process": (1, 8, ()), "FSDP 4": (4, 2, ()),
                 "FSDP 2 x PP 2 Interleaved1F1B": (4, 4, INTERLEAVED_PP2)}


@pytest.fixture(scope="module")
def resumed_in_four_processes(killed_at_10, tmp_path_factory) -> dict[str, str]:
    """The 4-process layouts resumed from the step-10 checkpoint, one after the other in one
    process group (tests/workers/run_many.py): layout -> its dump folder."""
    runs = {}
    for name, (nproc, local, layout) in OTHER_LAYOUTS.items():
        if nproc == 4:
            dump = tmp_path_factory.mktemp("resumed-4")
            shutil.copytree(killed_at_10 / "checkpoint" / "step-10", dump / "checkpoint" / "step-10")
            runs[name] = ["--training.local_batch_size", str(local), *layout, "--job.dump_folder", str(dump)]
    found, _ = run_many(4, [*JOB, "--training.global_batch_size", "8", "--checkpoint.enable"], runs,
                        tmp_path_factory.mktemp("resumed-4-group"))
    for name, result in found.items():
        assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in result["log"], result["log"][-2000:]
    return {name: result["dump"] for name, result in found.items()}


@pytest.mark.parametrize("name", list(OTHER_LAYOUTS))
def test_resume_under_another_layout(tmp_path, killed_at_10, uninterrupted, name, measured, request):
    # Steps 11-20 depend only on the step-10 state (weights, optimizer, schedule, data position).
    nproc, local, layout = OTHER_LAYOUTS[name]
    if nproc == 4:
        tmp_path = Path(request.getfixturevalue("resumed_in_four_processes")[name])
    else:
        shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
        result = launch(nproc, [*JOB, "--training.global_batch_size", "8",
                                "--training.local_batch_size", str(local), *layout,
                                "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
        assert result.returncode == 0, describe(result)
    losses = losses_by_step(tmp_path)
    diff = max(abs(losses[s] - uninterrupted[s]) for s in range(11, 21))
    measured(f"saved at FSDP 2, resumed at {name}: steps 11-20 max |loss diff| {diff:.2e}")
    assert diff <= 1e-5
    assert min(losses) == 11  # data position restored: it continued at step 11, not step 1


def test_pipeline_resume_restores_every_stage(tmp_path):
    """PP 2 resumed from its own checkpoint: each stage gets back its own optimizer settings,
    including a second parameter group that only stage 0 holds (the embedding, not decayed)."""
    job = [*TINY_JOB, "--training.steps", "8", "--training.seq_len", "64", "--training.local_batch_size", "8",
           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "4",
           "--optimizer.weight_decay", "0.5", "--optimizer.weight_decay_exclude", "embedding",
           "--checkpoint.enable", "--checkpoint.interval", "4"]
    result = launch(2, [*job, "--job.dump_folder", str(tmp_path / "full")])
    assert result.returncode == 0, describe(result)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-4", tmp_path / "resumed" / "checkpoint" / "step-4")
    result = launch(2, [*job, "--job.dump_folder", str(tmp_path / "resumed")])
    assert result.returncode == 0, describe(result)
    assert "(step 4)" in result.stdout
    uninterrupted, resumed = losses_by_step(tmp_path / "full"), losses_by_step(tmp_path / "resumed")
    assert [resumed[s] for s in range(5, 9)] == [uninterrupted[s] for s in range(5, 9)]


def test_retention_async_save_and_model_only_export(seed, tmp_path):
    shutil.copytree(seed, tmp_path / "checkpoint" / "step-0")
    result = launch(2, [*TINY_JOB, "--training.steps", "8", "--training.local_batch_size", "4", "--checkpoint.enable",
                        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode",
                        "async", "--checkpoint.export_dtype", "bfloat16", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert f"loaded model from {tmp_path / 'checkpoint' / 'step-0'}" in result.stdout  # the seed in its folder
    assert listing(tmp_path / "checkpoint") == ["lineage.json", "step-0", "step-6", "step-8"]
    full = torch.load(dcp_to_torch_save(str(tmp_path / "checkpoint" / "step-6"), str(tmp_path / "6.pt")) or
                      tmp_path / "6.pt", weights_only=False)
    assert set(full) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    assert full["train_state"] == {"step": 6, "tokens_seen": 6 * 8 * 32} and full["dataloader"]["rows_consumed"] == 6 * 8
    last = torch.load(dcp_to_torch_save(str(tmp_path / "checkpoint" / "step-8"), str(tmp_path / "8.pt")) or
                      tmp_path / "8.pt", weights_only=False)
    assert set(last) == set(full)  # the last save is full too: raising training.steps continues it
    export = model_tensors(tmp_path / "checkpoint" / "step-8" / "model_only", tmp_path)
    assert {t.dtype for t in export.values()} == {torch.bfloat16}
    assert all(torch.equal(export[k], last["model"][k].to(torch.bfloat16)) for k in export)
    record = json.loads((tmp_path / "checkpoint" / "step-8" / "checkpoint.json").read_text())
    assert (record["step"], record["kind"], record["exports"], record["export_dtype"]) == (8, "final", ["model_only"],
                                                                                          "bfloat16")


@pytest.fixture(scope="module")
def other_model_seed(tmp_path_factory):
    dump = tmp_path_factory.mktemp("debugmodel-seed")
    result = launch(1, ["--model.flavor", "debugmodel", "--job.dump_folder", str(dump),
                        "--checkpoint.create_seed_checkpoint"])
    assert result.returncode == 0, describe(result)
    return dump / "checkpoint" / "step-0"


def test_bad_checkpoint_input(tmp_path, seed, other_model_seed):
    def refused(*args) -> str:
        """Mistakes found from the file system stop in the launcher's preflight: exit 2, no processes."""
        result = launch(1, [*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "8", *args])
        assert result.returncode == 2, describe(result)
        return result.stdout + result.stderr

    assert "initial_load_path: " in refused("--checkpoint.initial_load_path", str(tmp_path / "nope"),
                                            "--job.dump_folder", str(tmp_path / "a"))
    (tmp_path / "c" / "checkpoint").mkdir(parents=True)
    message = refused("--checkpoint.enable", "--checkpoint.load_step", "4", "--job.dump_folder", str(tmp_path / "c"))
    assert "no checkpoint of step 4" in message and "complete checkpoints: none" in message
    shutil.copytree(seed, tmp_path / "d" / "checkpoint" / ".step-4.partial")
    (tmp_path / "d" / "checkpoint" / ".step-4.partial" / ".metadata").unlink()  # DCP writes it last
    message = refused("--checkpoint.enable", "--checkpoint.load_step", "4", "--job.dump_folder", str(tmp_path / "d"))
    assert "the save of step 4" in message and "never completed" in message
    (tmp_path / "e").mkdir()
    assert "is not a complete DCP checkpoint" in refused("--checkpoint.initial_load_path", str(tmp_path / "e"),
                                                         "--job.dump_folder", str(tmp_path / "f"))
    assert "has no config.json" in refused("--checkpoint.initial_load_path", str(tmp_path / "e"),
                                           "--checkpoint.initial_load_in_hf", "--job.dump_folder", str(tmp_path / "f"))

    # Shapes need the model: found by the trainer, which stops with the parameter named.
    other = launch(1, [*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "8",
                       "--checkpoint.initial_load_path", str(other_model_seed), "--job.dump_folder", str(tmp_path / "b")])
    assert other.returncode != 0
    assert "parameter tok_embeddings.weight has shape [2048, 256] in the checkpoint but [256, 64]" in other.stderr


def test_stale_partial_save_is_ignored_and_removed(tmp_path, killed_at_10):
    shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / ".step-15.partial")
    (tmp_path / "checkpoint" / ".step-15.partial" / ".metadata").unlink()  # DCP writes it last
    result = launch(2, [*RESUMABLE, "--training.steps", "11", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert "a save that never completed" in result.stdout
    assert "(step 10)" in result.stdout and not (tmp_path / "checkpoint" / ".step-15.partial").exists()


def test_older_load_step_never_overwrites_newer_checkpoints(tmp_path, killed_at_10):
    for step in ("step-10",):
        shutil.copytree(killed_at_10 / "checkpoint" / step, tmp_path / "checkpoint" / step)
    shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-5")
    result = launch(2, [*RESUMABLE, "--checkpoint.load_step", "5", "--job.dump_folder", str(tmp_path)])
    assert result.returncode != 0
    assert "holds newer checkpoints (step-10) that this run would overwrite" in result.stderr


@pytest.mark.smoke
def test_hugging_face_weights_in_and_out_of_a_run(tmp_path):
    """Start from a Hugging Face folder, train one step at lr 0, export: the same tensors come back."""
    from safetensors.torch import load_file

    from trainer.models.llama3 import Transformer, get_flavor
    from trainer.hf.folder import write_hf_folder

    args = get_flavor("tiny")
    args.max_seq_len = 32
    model = Transformer(args)
    model.init_weights(11)
    write_hf_folder(tmp_path / "hf_in", model.state_dict(), args)
    result = launch(2, [*TINY_JOB, "--training.steps", "1", "--optimizer.lr", "0", "--training.local_batch_size", "4",
                        "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
                        "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf",
                        "--job.dump_folder", str(tmp_path / "run")])
    assert result.returncode == 0, describe(result)
    assert "loaded model weights from the Hugging Face folder" in result.stdout
    exported = load_file(str(tmp_path / "run" / "checkpoint" / "step-1" / "hf" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_a_step_folder_loads_from_its_hugging_face_export(tmp_path):
    """A run saved with last_save_in_hf; a new run names that step-N with initial_load_in_hf and
    reads step-N/hf/. Its step-1 loss equals that of a run loading step-N's own (DCP) weights."""
    saved = tmp_path / "saved" / "checkpoint"
    result = launch(2, [*TINY_JOB, "--training.steps", "3", "--training.local_batch_size", "4", "--checkpoint.enable",
                        "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf",
                        "--job.dump_folder", str(tmp_path / "saved")])
    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in (saved / "step-3").iterdir() if p.is_dir()) == ["hf", "model_only"]

    def first_loss(name: str, *load: str) -> tuple[float, str]:
        result = launch(1, [*TINY_JOB, "--training.steps", "1", "--training.local_batch_size", "8",
                            "--checkpoint.initial_load_path", *load, "--job.dump_folder", str(tmp_path / name)])
        assert result.returncode == 0, describe(result)
        return read_metrics(tmp_path / name)[0]["loss"], result.stdout

    from_dcp, _ = first_loss("from-dcp", str(saved / "step-3"))
    from_hf, output = first_loss("from-hf", str(saved / "step-3"), "--checkpoint.initial_load_in_hf")
    assert f"checkpoint.initial_load_path {saved / 'step-3'}: reading its Hugging Face export {saved / 'step-3' / 'hf'}" \
        in output
    assert f"loaded model weights from the Hugging Face folder {saved / 'step-3' / 'hf'}" in output
    print(f"step-1 loss from step-3: DCP {from_dcp:.8f}, its hf/ export {from_hf:.8f}")
    assert from_hf == from_dcp  # float32 export: the same weights, bitwise
    start = json.loads((tmp_path / "from-hf" / "run_meta.json").read_text())["start"]
    assert (start["kind"], start["path"]) == ("hugging_face", str((saved / "step-3" / "hf").resolve()))

    # step-2 was a periodic save, without an export: refused before any process starts.
    refused = launch(1, [*TINY_JOB, "--training.steps", "1", "--training.local_batch_size", "8",
                         "--checkpoint.initial_load_path", str(saved / "step-2"), "--checkpoint.initial_load_in_hf",
                         "--job.dump_folder", str(tmp_path / "refused")])
    assert refused.returncode == 2, describe(refused)
    assert (f"checkpoint.initial_load_path: {saved / 'step-2'} has no config.json, nor hf/config.json; with "
            "checkpoint.initial_load_in_hf it must be a Hugging Face model folder") in refused.stderr
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_exclude_from_loading(tmp_path, killed_at_10, uninterrupted):
    shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    result = launch(2, [*RESUMABLE, "--training.steps", "11", "--checkpoint.exclude_from_loading", "dataloader",
                        "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert "loaded model, optimizer, lr_scheduler, train_state from" in result.stdout
    losses = losses_by_step(tmp_path)
    assert list(losses) == [11]  # the step counter came back...
    assert losses[11] != uninterrupted[11]  # ...the data position did not: step 11 trained on batch 1


def test_hugging_face_export_of_a_pipeline_run_has_every_stage(seed, tmp_path):
    """Each PP rank holds some layers; the export is read from the checkpoint, which has them all."""
    from safetensors.torch import load_file

    from trainer.checkpoint.dcp_read import read_model_state
    from trainer.models.llama3 import get_flavor
    from trainer.hf.weights import to_hf

    result = launch(4, [*TINY_JOB, "--training.steps", "1", "--optimizer.lr", "0", "--training.local_batch_size", "4",
                        *INTERLEAVED_PP2, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
                        "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    exported = load_file(str(tmp_path / "checkpoint" / "step-1" / "hf" / "model.safetensors"))
    args = get_flavor("tiny")
    expected = to_hf(read_model_state(seed), args)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


class _Position:
    """Stands in for the data loader: the manager saves its state_dict."""

    def state_dict(self) -> dict:
        return {"step": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def _two_async_saves(rank: int, mode: str, folder: str, results) -> None:
    """One process: two asynchronous saves of a small model, recording what DCP staged each time."""
    import time as clock

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    from trainer.checkpoint.manager import CheckpointManager
    from trainer.checkpoint.items import TrainState
    from trainer.config.job_config import JobConfig
    from trainer.launch.process_exit import exit_without_teardown

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
    staged = []
    original_stage = StateDictStager.stage
    StateDictStager.stage = lambda self, state, **kw: staged.append(original_stage(self, state, **kw)) or staged[-1]
    config = JobConfig()
    config.job.dump_folder, config.checkpoint.enable, config.checkpoint.async_mode = folder, True, mode
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    manager = CheckpointManager(config, model=model, optimizer=optimizer, scheduler=scheduler, loader=_Position(),
                                train_state=TrainState(), rank=0)
    published = []
    for step in (1, 2):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        manager.save(step)
        expected = model.weight.detach().clone()
        # Published without any further call: poll the folder, as a crash right now would find it.
        deadline = clock.time() + 10
        while not (manager.folder / f"step-{step}").exists() and clock.time() < deadline:
            clock.sleep(0.01)
        published.append((manager.folder / f"step-{step}" / ".metadata").is_file())
    manager.wait()
    loaded = {"model": {"weight": torch.zeros(16, 16), "bias": torch.zeros(16)}}
    dcp.load(loaded, checkpoint_id=str(manager.folder / "step-2"))
    weights = [s["model"]["weight"] for s in staged]
    results.update(published=published, staged=len(staged), same_storage=(
        weights[0].untyped_storage().data_ptr() == weights[1].untyped_storage().data_ptr()),
        round_trip=torch.equal(loaded["model"]["weight"], expected), record=(manager.folder / "step-2" /
                                                                              "checkpoint.json").is_file())
    dist.destroy_process_group()
    exit_without_teardown(0)  # this process ran gloo collectives: see trainer.launch.process_exit


@pytest.mark.parametrize("mode, reuses", [("async", False), ("async_with_pinned_mem", True)])
def test_async_save_is_published_when_complete_and_pinned_mode_reuses_its_buffers(tmp_path, mode, reuses):
    """Each asynchronous save appears as step-N as soon as it is written, not at the next save;
    async_with_pinned_mem stages every save into the same CPU buffers (pinned with CUDA), async
    into fresh memory each time; both round-trip exactly."""
    with mp.Manager() as shared:
        results = shared.dict()
        start_ranks(_two_async_saves, (mode, str(tmp_path), results), 1)
        results = dict(results)
    assert results["staged"] == 2 and results["same_storage"] is reuses
    assert results["published"] == [True, True]
    assert results["record"] and results["round_trip"]


def test_a_stop_signal_saves_stops_with_75_and_the_same_command_resumes_onto_the_same_curve(tmp_path, uninterrupted):
    """SIGUSR1 to the launcher (what SLURM sends before a time limit) as soon as it listens, before
    its ranks exist: it passes the signal on once they handle it, they agree on step 1 + 2, save
    it and stop (exit 75); started again, the run resumes from step 3 onto the uninterrupted curve."""
    args = [*RESUMABLE, "--job.dump_folder", str(tmp_path)]
    # Real processes: the test waits until the launcher itself handles SIGUSR1.
    env = dict(os.environ, NGPU="2", PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **REAL_PROCESSES)
    proc = subprocess.Popen([str(LAUNCHER), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not catches(proc.pid, signal.SIGUSR1) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, f"{out[-3000:]}\n{err[-3000:]}"
    assert "every rank saves a checkpoint after step 3 and stops" in out
    assert "stopped: saved a checkpoint at step 3 on SIGUSR1 and stopped; start the same command again" in err
    assert listing(tmp_path / "checkpoint") == ["lineage.json", "step-3"]
    record = json.loads((tmp_path / "run_meta.json").read_text())
    assert (record["status"], record["last_step"]) == ("interrupted", 3)

    result = launch(2, args)
    assert result.returncode == 0, describe(result)
    assert losses_by_step(tmp_path) == uninterrupted  # every step once, bitwise the uninterrupted losses
    record = json.loads((tmp_path / "run_meta.json").read_text())
    assert record["status"] == "completed" and [h["status"] for h in record["history"]] == ["interrupted"]
