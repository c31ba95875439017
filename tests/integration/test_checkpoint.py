"""Checkpoints: seed checkpoints, exact resume after SIGKILL, resharding, retention, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launch import LAUNCHER, REPO, TINY_JOB, descendants, describe, launch, read_metrics

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
    assert sorted(p.name for p in seed.parent.iterdir()) == ["step-0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dump = tmp_path_factory.mktemp("uninterrupted")
    result = launch(2, [*JOB, "--training.local_batch_size", "4", "--job.dump_folder", str(dump)])
    assert result.returncode == 0, describe(result)
    return losses_by_step(dump)


def kill_after_checkpoint(args, dump, step: int, nproc: int = 2) -> None:
    """Start a run and SIGKILL all its processes as soon as the checkpoint of `step` is published."""
    env = dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([str(LAUNCHER), *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    published = dump / "checkpoint" / f"step-{step}"
    deadline = time.time() + 240
    while not published.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)  # the log reaches us late; the folder appears the moment it is renamed
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
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-10"]
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
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == (["step-4", "step-6"] if not options else ["step-6"])
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


INTERLEAVED_PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                   "Interleaved1F1B")


@pytest.mark.parametrize("name, nproc, local, layout", [
    ("1 process", 1, 8, ()), ("FSDP 4", 4, 2, ()), ("FSDP 2 x PP 2 Interleaved1F1B", 4, 4, INTERLEAVED_PP2)])
def test_resume_under_another_layout(tmp_path, killed_at_10, uninterrupted, name, nproc, local, layout, measured):
    shutil.copytree(killed_at_10 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    # Steps 11-20 depend only on the step-10 state (weights, optimizer, schedule, data position).
    result = launch(nproc, [*JOB, "--training.global_batch_size", "8",
                            "--training.local_batch_size", str(local), *layout,
                            "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    losses = losses_by_step(tmp_path)
    diff = max(abs(losses[s] - uninterrupted[s]) for s in range(11, 21))
    measured(f"saved at FSDP 2, resumed at {name}: steps 11-20 max |loss diff| {diff:.2e}")
    assert diff <= 1e-5
    assert min(losses) == 11  # data position restored: it continued at step 11, not step 1


def test_retention_async_save_and_model_only_export(seed, tmp_path):
    shutil.copytree(seed, tmp_path / "checkpoint" / "step-0")
    result = launch(2, [*TINY_JOB, "--training.steps", "8", "--training.local_batch_size", "4", "--checkpoint.enable",
                        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode",
                        "async", "--checkpoint.export_dtype", "bfloat16", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    assert f"loaded model from {tmp_path / 'checkpoint' / 'step-0'}" in result.stdout  # the seed in its folder
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-0", "step-6", "step-8"]
    full = torch.load(dcp_to_torch_save(str(tmp_path / "checkpoint" / "step-6"), str(tmp_path / "6.pt")) or
                      tmp_path / "6.pt", weights_only=False)
    assert set(full) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    assert full["train_state"] == {"step": 6, "tokens_seen": 6 * 8 * 32} and full["dataloader"]["step"] == 6
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


def test_hugging_face_weights_in_and_out_of_a_run(tmp_path):
    """Start from a Hugging Face folder, train one step at lr 0, export: the same tensors come back."""
    from safetensors.torch import load_file

    from trainer.models.llama3 import Transformer, get_flavor
    from trainer.models.llama3.hf_adapter import write_hf_folder

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

    from trainer.checkpoint import read_model_state
    from trainer.models.llama3 import get_flavor
    from trainer.models.llama3.hf_adapter import to_hf

    result = launch(4, [*TINY_JOB, "--training.steps", "1", "--optimizer.lr", "0", "--training.local_batch_size", "4",
                        *INTERLEAVED_PP2, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
                        "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, describe(result)
    exported = load_file(str(tmp_path / "checkpoint" / "step-1" / "hf" / "model.safetensors"))
    args = get_flavor("tiny")
    expected = to_hf(read_model_state(seed), args)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
