"""What a run saved is never lost or silently wrong: rewinds start a new lineage instead of
splicing two trajectories, a crash while exporting keeps the final checkpoint, a save that
cannot be written (full disk, on one rank) stops the run and keeps the older checkpoints, and a
checkpoint trained as another model variant is refused.

Faults are injected into the ranks by a sitecustomize module on PYTHONPATH that wraps DCP's file
writer (tests only; the trainer has no fault hooks).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.launch import REPO, TINY_JOB, describe, launch, read_metrics, run_many
from tests.warm_python.server import ORDER_INDEPENDENT

FAULTS = ORDER_INDEPENDENT + '''
import os
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if os.environ.get("RANK") is not None and os.environ.get("FAULT") and (first_attempt or not os.environ.get("FAULT_ONCE")):
    import errno, signal
    from contextlib import contextmanager
    from torch.distributed.checkpoint import filesystem

    kind, where, rank = os.environ["FAULT"].split(":")
    original = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if where in str(path) and os.environ["RANK"] == rank and "w" in mode:
            if kind == "enospc":  # a write that runs out of space part-way
                with original(self, path, mode) as stream:
                    stream.write(b"x" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            os.kill(os.getpid(), signal.SIGKILL)  # kind "kill": the process dies while writing
        with original(self, path, mode) as stream:
            yield stream

    filesystem.FileSystem.create_stream = create_stream
'''


def launch_with_fault(tmp_path: Path, nproc: int, args: list[str], fault: str, max_restarts: int | None = None,
                      once: bool = False):
    """`fault` is kind:path-part:rank; `once`: only in the first attempt (not after a restart)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(FAULTS)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAULT", "FAULT_ONCE", "MAX_RESTARTS")}
    os.environ.update(PYTHONPATH=f"{hooks}:{REPO}", FAULT=fault)
    if once:
        os.environ["FAULT_ONCE"] = "1"
    if max_restarts is not None:
        os.environ["MAX_RESTARTS"] = str(max_restarts)
    try:
        return launch(nproc, args)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def record(path: Path) -> dict:
    return json.loads((path / "checkpoint.json").read_text())


def losses(dump: Path) -> dict[int, float]:
    rows = read_metrics(dump)
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step recorded twice: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def test_a_rewind_is_a_new_lineage_and_never_spliced(tmp_path, measured):
    dump = tmp_path / "run"
    base = [*TINY_JOB, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only",
            "--job.dump_folder", str(dump)]
    first = launch(1, [*base, "--training.steps", "8"])
    assert first.returncode == 0, describe(first)
    abandoned = losses(dump)
    folder = dump / "checkpoint"
    old_lineage = record(folder / "step-8")["lineage"]
    assert record(folder / "step-4")["lineage"] == old_lineage
    assert record(folder / "step-4")["parent"]["step"] == 2 and record(folder / "step-2")["parent"] is None

    # Rewind to step 4 with another learning rate, to step 6; then continue to 10 as the docs say.
    rewind = launch(1, [*base, "--training.steps", "6", "--optimizer.lr", "1e-3", "--checkpoint.load_step", "4",
                        "--checkpoint.overwrite"])
    assert rewind.returncode == 0, describe(rewind)
    moved = list((folder / "previous").glob("*-after-step-4"))
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == ["step-6", "step-8"]
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4", "step-6"]
    new_lineage = record(folder / "step-6")["lineage"]
    assert new_lineage != old_lineage and record(folder / "step-6")["parent"]["step"] == 4

    more = launch(1, [*base, "--training.steps", "10", "--optimizer.lr", "1e-3"])
    assert more.returncode == 0, describe(more)
    assert f"from {folder / 'step-6'} (step 6)" in more.stdout, describe(more)
    curve = losses(dump)
    assert sorted(curve) == list(range(1, 11))
    assert all(curve[s] == abandoned[s] for s in range(1, 5))  # the shared trajectory
    assert all(curve[s] != abandoned[s] for s in range(6, 9))  # the new one, not the abandoned steps 6-8
    assert record(folder / "step-10")["lineage"] == new_lineage

    # The abandoned step-8 copied back is refused by name, not resumed.
    shutil.copytree(moved[0] / "step-8", folder / "step-12")
    (folder / "step-12" / "checkpoint.json").write_text(
        json.dumps({**record(folder / "step-12"), "step": 12}))
    refused = launch(1, [*base, "--training.steps", "14", "--optimizer.lr", "1e-3"])
    assert refused.returncode == 2, describe(refused)
    assert f"{folder / 'step-12'} belongs to another training trajectory" in refused.stderr
    measured("rewind: steps 6-8 of the new lineage differ from the abandoned ones by up to "
             f"{max(abs(curve[s] - abandoned[s]) for s in range(6, 9)):.2e}")


def test_metrics_hold_one_trajectory_whatever_runs_share_the_folder(tmp_path):
    """Sequences of runs in one dump folder that spliced two trajectories into one metrics.jsonl:
    (a) a run without checkpoints (another seed) between a run and its resume; (b) an older
    checkpoint loaded without saving (load_step + load_only, another weight decay, which the
    trainer's own refusal suggests), then a plain resume of the newest checkpoint. Each resume's
    metrics.jsonl is its own trajectory from step 1: the saved run's steps, then the new ones;
    every other curve stays whole in previous/. All runs in one process (tests/workers/run_many.py)."""
    dump = tmp_path / "run"
    base = [*TINY_JOB, "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only", "--job.dump_folder",
            str(dump)]
    saving = ["--checkpoint.enable"]
    runs = {
        "first": [*saving, "--training.steps", "6"],
        "(a) no checkpoints, another seed": ["--training.steps", "2", "--debug.seed", "7"],
        "(a) resume": [*saving, "--training.steps", "8"],
        "(b) step 3, load_only": [*saving, "--training.steps", "6", "--checkpoint.load_step", "3",
                                  "--checkpoint.load_only", "--optimizer.weight_decay", "0.05"],
        "(b) resume": [*saving, "--training.steps", "10"],
    }
    results, _ = run_many(1, base, runs, tmp_path)
    losses = {name: {row["step"]: row["loss"] for row in result["metrics"]} for name, result in results.items()}
    first, branch = losses["first"], losses["(b) step 3, load_only"]
    assert sorted(losses["(a) resume"]) == list(range(1, 9))
    assert all(losses["(a) resume"][s] == first[s] for s in range(1, 7)), "steps 1-6 are not the saved run's"
    assert sorted(branch) == list(range(1, 7))
    assert all(branch[s] == first[s] for s in range(1, 4)) and all(branch[s] != first[s] for s in range(5, 7))
    final = losses["(b) resume"]
    assert sorted(final) == list(range(1, 11))
    assert all(final[s] == losses["(a) resume"][s] for s in range(1, 9)), "the load_only branch was spliced in"
    # Every curve written is kept whole in previous/: the first run's, the other seed's, the branch's.
    kept = sorted(tuple(row["step"] for row in read_metrics(folder))
                  for folder in (dump / "previous").iterdir() if (folder / "run_meta.json").is_file())
    assert (1, 2) in kept and (1, 2, 3, 4, 5, 6) in kept
    record = json.loads((dump / "run_meta.json").read_text())
    assert record["trajectory"]["lineage"] == json.loads((dump / "checkpoint" / "step-10" / "checkpoint.json")
                                                         .read_text())["lineage"]
    assert [start["start"]["step"] for start in record["history"]] == [0, 6]  # the trajectory's own starts


def test_a_crash_while_exporting_keeps_the_final_checkpoint(tmp_path):
    dump = tmp_path / "run"

    def job(steps: int) -> list[str]:
        return [*TINY_JOB, "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "3",
                "--job.dump_folder", str(dump)]

    crashed = launch_with_fault(tmp_path, 2, [*job(6), "--checkpoint.last_save_in_hf"], "kill:model_only:1",
                                max_restarts=0)
    assert crashed.returncode == 128 + 9, describe(crashed)
    final = dump / "checkpoint" / "step-6"
    assert (final / ".metadata").is_file() and record(final)["kind"] == "final"
    assert (final / ".model_only.partial").exists() and not (final / "model_only").exists()

    # The run is complete; the next start drops the unfinished export and writes the missing ones.
    again = launch(2, [*job(6), "--checkpoint.last_save_in_hf"])
    assert again.returncode == 0, describe(again)
    assert "nothing to do but its exports, written now (model_only, hf)" in again.stdout, describe(again)
    assert not (final / ".model_only.partial").exists()
    assert record(final)["exports"] == ["model_only", "hf"]
    assert (final / "model_only" / ".metadata").is_file() and (final / "hf" / "config.json").is_file()
    assert sorted(losses(dump)) == list(range(1, 7))  # nothing trained again

    longer = launch(2, job(8))  # continues from the final checkpoint, not from step 3
    assert longer.returncode == 0, describe(longer)
    assert f"from {final} (step 6)" in longer.stdout, describe(longer)
    assert sorted(losses(dump)) == list(range(1, 9))


@pytest.mark.cores(2)
def test_a_restart_after_a_crash_while_exporting_finishes_the_exports(tmp_path):
    """With automatic restarts (the default for runs that save) the job recovers by itself."""
    dump = tmp_path / "run"
    args = [*TINY_JOB, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "4",
            "--job.dump_folder", str(dump)]
    recovered = launch_with_fault(tmp_path, 2, args, "kill:.model_only.partial:1", once=True)
    assert recovered.returncode == 0, describe(recovered)
    assert "restart 1 of" in recovered.stderr, describe(recovered)
    final = dump / "checkpoint" / "step-4"
    assert record(final)["exports"] == ["model_only"] and (final / "model_only" / ".metadata").is_file()
    assert sorted(losses(dump)) == list(range(1, 5))


@pytest.mark.cores(2)
def test_a_save_that_fails_on_one_rank_stops_the_run_and_keeps_the_older_checkpoints(tmp_path):
    dump = tmp_path / "run"
    args = [*TINY_JOB, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.keep_latest_k", "1", "--job.dump_folder", str(dump)]
    failed = launch_with_fault(tmp_path, 2, args, "enospc:.step-4.partial:1")
    assert failed.returncode == 2, describe(failed)
    assert "checkpoint step-4 could not be written" in failed.stderr
    assert "No space left on device" in failed.stderr and "step-2, the newest complete checkpoint, is intact" in failed.stderr
    folder = dump / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(("step-", ".step-"))) == ["step-2"]

    resumed = launch(2, args)  # space again: the run continues from step-2
    assert resumed.returncode == 0, describe(resumed)
    assert sorted(losses(dump)) == list(range(1, 7))
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-6"]  # keep_latest_k 1, after the save worked


POISON = ORDER_INDEPENDENT + """
import os
if os.environ.get("RANK") == os.environ.get("POISON_RANK") and os.environ.get("POISON_AT_STEP"):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def poison(optimizer, args, kwargs):  # one weight becomes infinite in the update of step N
        if optimizer.param_groups[0]["lr"] == 0:  # the state's creation (trainer.optim.initialize_state)
            return
        steps.append(1)
        if len(steps) == int(os.environ["POISON_AT_STEP"]):
            p = optimizer.param_groups[0]["params"][0]
            with torch.no_grad():
                (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = float("inf")

    register_optimizer_step_post_hook(poison)
"""


def test_non_finite_weights_are_never_published_and_not_restarted(tmp_path):
    """An update that leaves a weight infinite while the step's loss and gradient norm were finite
    (a learning rate far too high does it): the save of that step is refused on every rank, the
    run stops with exit 3 (it would diverge again from the same checkpoint: no restart), and the
    newest checkpoint is the one before."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(POISON)
    dump = tmp_path / "run"
    args = [*TINY_JOB, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
            "--job.dump_folder", str(dump)]
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "POISON_RANK", "POISON_AT_STEP")}
    os.environ.update(PYTHONPATH=f"{hooks}:{REPO}", POISON_RANK="1", POISON_AT_STEP="6")
    try:
        result = launch(2, args)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert result.returncode == 3, describe(result)
    assert ("step 6: the parameters are not finite after the update (a value is NaN or infinite); stopped before saving "
            "step-6, so that no checkpoint holds them (step-3 is the newest)") in result.stderr
    assert "restart" not in result.stderr
    assert sorted(p.name for p in (dump / "checkpoint").iterdir() if "step" in p.name) == ["step-3"]
    record = json.loads((dump / "run_meta.json").read_text())
    assert record["status"] == "failed" and "not finite" in record["error"]


def test_a_checkpoint_of_another_model_variant_is_refused(tmp_path):
    dump = tmp_path / "grouped"
    trained = launch(2, [*TINY_JOB, "--training.steps", "2", "--checkpoint.enable", "--parallelism.tensor_parallel_degree",
                         "2", "--parallelism.tensor_parallel_sync", "grouped", "--parallelism.tensor_parallel_sync_group",
                         "2", "--checkpoint.no_last_save_model_only", "--job.dump_folder", str(dump)])
    assert trained.returncode == 0, describe(trained)
    step = dump / "checkpoint" / "step-2"
    into = [*TINY_JOB, "--training.steps", "3", "--checkpoint.initial_load_path", str(step),
            "--checkpoint.initial_load_model_only=false", "--job.dump_folder", str(tmp_path / "exact")]
    refused = launch(1, into)
    assert refused.returncode == 2, describe(refused)
    assert (f'{step} was trained as tensor_parallel_sync = "grouped", 2 blocks per sync at tensor_parallel_degree 2'
            in refused.stderr and "--checkpoint.accept_model_change" in refused.stderr)
    accepted = launch(1, [*into, "--checkpoint.accept_model_change"])
    assert accepted.returncode == 0, describe(accepted)
    assert "was trained as" in accepted.stdout + accepted.stderr  # still said, as a warning


def test_a_crafted_checkpoint_given_to_a_run_runs_nothing(tmp_path):
    """A step folder whose .metadata pickles a shell command, passed as initial_load_path: one
    message naming the file (exit 2), and the command never ran."""
    from tests.unit.test_dcp_metadata import crafted_folder

    folder, marker = crafted_folder(tmp_path)
    refused = launch(1, [*TINY_JOB, "--training.steps", "2", "--checkpoint.initial_load_path", str(folder),
                         "--job.dump_folder", str(tmp_path / "run")])
    assert refused.returncode == 2, describe(refused)
    assert f"{folder / '.metadata'}: refusing to load 'posix.system'" in refused.stderr, describe(refused)
    assert not marker.exists()


def test_a_flipped_bit_in_a_pipeline_stage_shard_is_refused_on_resume(tmp_path):
    """Two pipeline stages save a checkpoint with its checksums (each stage rank its own file);
    one bit flipped in the middle of the largest tensor of stage 1's file: the resume stops with
    one message naming the file and the tensor (exit 2, no restart), and
    checkpoint.verify_checksums = false loads it anyway."""
    dump = tmp_path / "run"
    job = [*TINY_JOB, "--checkpoint.enable", "--checkpoint.interval", "2", "--parallelism.pipeline_parallel_degree",
           "2", "--job.dump_folder", str(dump)]
    trained = launch(2, [*job, "--training.steps", "2"])
    assert trained.returncode == 0, describe(trained)
    step = dump / "checkpoint" / "step-2"
    checksums = json.loads((step / "checksums.json").read_text())
    assert sorted(checksums["files"]) == ["__0_0.distcp", "__1_0.distcp"]
    assert (step / "model_only" / "checksums.json").is_file()  # the export has its own
    largest = max(checksums["files"]["__1_0.distcp"]["items"], key=lambda item: item["length"])
    raw = bytearray((step / "__1_0.distcp").read_bytes())
    raw[largest["offset"] + largest["length"] // 2] ^= 0x10
    (step / "__1_0.distcp").write_bytes(bytes(raw))
    refused = launch(2, [*job, "--training.steps", "3"])
    assert refused.returncode == 2, describe(refused)
    assert (f"{step / '__1_0.distcp'}: checksum mismatch in tensors {largest['key']}: the file was changed or "
            "corrupted after it was saved") in refused.stderr, describe(refused)
    assert "restart" not in refused.stderr
    forced = launch(2, [*job, "--training.steps", "3", "--checkpoint.verify_checksums=false"])
    assert forced.returncode == 0, describe(forced)
