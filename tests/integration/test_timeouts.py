"""Collectives against comm.train_timeout_seconds, each with nothing beside it (`alone`,
tests/machine_share.py): a slow healthy collective on a loaded machine must not reach the timeout.

The timeout reaches the mesh's subgroups, not only the default process group: this file runs under
torchrun with 4 gloo ranks and the trainer's mesh (dp_shard=2 x tp=2). After
process_setup.set_collective_timeout(2), rank 1 stays away for 6 s while rank 0 waits for it in a
tensor-parallel all-reduce and rank 3 in a data-parallel (flattened mesh) all-reduce: both must
give up after about 2 s, not wait for rank 1.

A rank that hangs (SIGSTOP) in a job of the launcher: its peer gives up at the train timeout, the
launcher kills the stopped rank and restarts the job from its latest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_run_safety import RESTART_JOB, alive, run_with_signal
from tests.launch import describe, read_metrics

# A collective timed out against a deadline: nothing beside it (tests/machine_share.py).
pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT_S = 2
LATE_RANK, LATE_BY_S = 1, 6
# rank -> the mesh dimension whose collective it waits in (each group holds LATE_RANK)
WAITERS = {0: "tp", 3: "dp"}


def run_rank(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from trainer import process_setup
    from trainer.parallel.dims import ParallelDims

    rank, world = process_setup.init_distributed(torch.device("cpu"), timeout_s=60)
    meshes = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=world).build_mesh("cpu")
    process_setup.set_collective_timeout(TRAIN_TIMEOUT_S)
    if rank == LATE_RANK:
        time.sleep(LATE_BY_S)
    elif rank in WAITERS:
        group = meshes[WAITERS[rank]].get_group()
        assert LATE_RANK in dist.get_process_group_ranks(group)
        start, error = time.perf_counter(), None
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError as e:
            error = str(e)
        result = {"elapsed_s": time.perf_counter() - start, "error": error}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a group that timed out cannot be torn down cleanly


def test_subgroup_collective_times_out_at_train_timeout(tmp_path, measured):
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__,
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank, dim in WAITERS.items():
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"] is not None and "timed out" in result["error"].lower(), (dim, result)
        # gave up at the 2 s train timeout: not at once, and well before the late rank's 6 s
        assert TRAIN_TIMEOUT_S - 0.1 <= result["elapsed_s"] < 4.5, (dim, result)
        measured(f"train timeout {TRAIN_TIMEOUT_S} s, peer {LATE_BY_S} s late: the {dim} all-reduce gave up after "
                 f"{result['elapsed_s']:.2f} s")
    assert time.perf_counter() - started < 60


@pytest.mark.real_processes  # the launcher's ranks are stopped and killed
def test_a_stopped_rank_times_out_is_killed_and_the_job_recovers(tmp_path, measured):
    """SIGSTOP on rank 1: rank 0 gives up after comm.train_timeout_seconds; the launcher kills the
    stopped rank (SIGTERM would wait for it to be continued) and restarts."""
    args = [*RESTART_JOB, "--comm.train_timeout_seconds", "5", "--checkpoint.interval", "2", "--training.steps", "6"]
    started = time.perf_counter()
    result, processes = run_with_signal(tmp_path, [*args], signal.SIGSTOP, at_step=3)
    measured(f"rank 1 stopped at step 3 of 6, 5 s train timeout: recovered in {time.perf_counter() - started:.1f} s")
    assert result.returncode == 0, describe(result)
    # Rank 0 times out in a training collective (exit 1) or, when it reached the step-4 save first,
    # in the save's collectives (exit 2 from the checkpoint, which names the timeout and is restarted).
    died = ("rank 0 died (exit 1: " in result.stderr
            or "rank 0 died (exit 2: checkpoint step-4 could not be written" in result.stderr)
    assert died and "restart 1 of 3 from the latest checkpoint" in result.stderr, describe(result)
    assert ("(a peer did not join a collective within the timeout: comm.train_timeout_seconds = 5 s, "
            "comm.init_timeout_seconds = 300 s until the first step is done; rank 1 had stopped answering: it was "
            "stopped (SIGSTOP or a debugger) and killed by the launcher)") in result.stderr, describe(result)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 7))
    assert not [pid for pid in processes if alive(pid)]


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]))
