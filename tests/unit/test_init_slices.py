"""Initialization keeps each rank's shard as a slice of the full tensor (initialization.local_slices); the
slice must be exactly what DTensor's distribute_tensor keeps, for every placement the layouts
produce: FSDP (uneven and empty shards at 64 ranks), HSDP, FSDP over TP (a strided shard), CP and
PP. Each case is one rank of a fake world (torch's fake process group): the mesh and the
parallelized model are real, the full tensors random, no collective runs. The fake world is the
process's own process group, so the cases run in a process of their own, one after the other
(each world ended before the next begins): torch is started once, not once per case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launch import REPO

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CASES = {
    "FSDP 64, rank 63 (empty shards)": (64, 63, []),
    "FSDP 3 x TP 2 (uneven shards)": (6, 5, TP2),
    "HSDP 2 x 2 x TP 2": (8, 6, [*TP2, "--parallelism.data_parallel_replicate_degree", "2"]),
    "FSDP 3 x CP 2 x TP 2": (12, 7, [*TP2, "--parallelism.context_parallel_degree", "2"]),
    "PP 2 x FSDP 3 x TP 2": (12, 11, [*TP2, "--parallelism.pipeline_parallel_degree", "2",
                                      "--training.local_batch_size", "4"]),
}


@pytest.fixture(scope="module")
def checked() -> dict[str, int]:
    """case -> parameters checked, every case run by this module in one process."""
    result = subprocess.run([sys.executable, "-m", "tests.unit.test_init_slices", *CASES], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line.split(": checked ") for line in result.stdout.splitlines() if ": checked " in line]
    return {case: int(count.split()[0]) for case, count in lines}


@pytest.mark.parametrize("case", list(CASES))
def test_init_keeps_the_shard_distribute_tensor_keeps(case, checked):
    assert checked[case] > 20  # every parameter of the stages this rank holds


def check(world: int, rank: int, args: list[str]) -> int:
    import torch
    from torch.distributed.tensor import distribute_tensor

    from trainer.config.manager import load_config, with_default_config
    from trainer.estimate.fake_world import fake_process_group
    from trainer.model_build import build_on_meta, training_model_args
    from trainer.models.llama3.initialization import copy_global_into, local_slices
    from trainer.preflight.checks import plan_run

    config = load_config(with_default_config(["--model.flavor", "debugmodel", *args]))
    plan = plan_run(config, world)
    checked = 0
    with fake_process_group(rank, world):
        mesh = plan.dims.build_mesh("cpu")
        parallel = build_on_meta(config, plan.dims, mesh, torch.device("cpu"), training_model_args(config))
        for stage in parallel.stages.values():
            stage.to_empty(device="cpu")
            for name, param in stage.named_parameters():
                full = torch.randn(param.shape)
                expected = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                assert local_slices(full.shape, param.device_mesh, param.placements) is not None, param.placements
                with torch.no_grad():
                    copy_global_into(param, full)
                assert torch.equal(param.to_local(), expected), (name, param.placements)
                checked += 1
    return checked


if __name__ == "__main__":
    for name in sys.argv[1:]:  # case names; a failed check ends the process with its traceback
        print(f"{name}: checked {check(*CASES[name])} parameters", flush=True)
