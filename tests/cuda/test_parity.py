"""float32 training on the device follows the same run on the CPU to float32 rounding.

Both runs start from one seed checkpoint: the trainer fills each parameter from a generator on
the device it trains on (`Transformer.init_weights`), and CUDA's generator draws other numbers
than the CPU's, so the same debug.seed gives other initial weights on a GPU. From the same
weights and the same batches the two runs differ only in how their kernels round (summation
order, attention kernel; TF32 stays off for float32 matmuls).

Tolerance: on the CPU, rounding-level changes of this 20-step job (the initial weights perturbed
by half a float32 ulp, debug.init_perturbation 1; or FSDP over 2 ranks instead of 1 process,
which sums every gradient in another order) moved its losses by at most 9.5e-7, 1 ulp of a
float32 loss near 7. The device may round every op differently, so the bounds are 20 times that
at step 1 (same weights, forward only: 2e-5) and 100 times at every step (1e-4), for the loss and
the relative gradient norm. A computation that is not float32 misses them: the same job in
bfloat16 is 1.9e-4 off at step 1 and up to 2.1e-3 later.
"""

from __future__ import annotations

import json

import pytest

from tests.cuda.device import DEVICE, JOB, dtype_args, step_records, train
from tests.launch import describe
from tests.unit.test_tokenizer import sentences
from trainer.data.prepare import prepare
from trainer.data.tokenizer import train_tokenizer

STEP_ONE_TOLERANCE = 2e-5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A step-0 checkpoint of the debug model (made on the CPU, as seed checkpoints always are)."""
    dump = tmp_path_factory.mktemp("seed")
    result = train([*JOB, "--job.dump_folder", str(dump), "--checkpoint.create_seed_checkpoint"], device="cpu")
    assert result.returncode == 0, describe(result)
    return dump / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A prepared shard folder of generated documents (a 512-piece tokenizer), for document masking."""
    folder = tmp_path_factory.mktemp("text")
    with open(folder / "docs.jsonl", "w") as f:
        for doc in sentences(3000):
            f.write(json.dumps({"text": doc}) + "\n")
    tokenizer = train_tokenizer([str(folder / "docs.jsonl")], str(folder / "tok"), 512)
    prepare([str(folder / "docs.jsonl")], str(tokenizer), str(folder / "shards"), workers=1)
    return folder / "shards"


@pytest.mark.parametrize("data", ["synthetic", "shards, document masking"])
def test_float32_loss_on_the_device_matches_the_cpu(tmp_path, seed, shards, data, figure):
    args = [*JOB, "--training.steps", "20", *dtype_args("float32"), "--checkpoint.initial_load_path", str(seed),
            "--checkpoint.load_only"]
    if data != "synthetic":
        args += ["--training.dataset", "shards", "--training.dataset_path", str(shards), "--training.document_masking"]
    runs = {}
    for device in ("cpu", DEVICE):
        dump = tmp_path / device
        result = train([*args, "--job.dump_folder", str(dump)], device=device)
        assert result.returncode == 0, describe(result)
        assert f"loaded model from {seed}" in result.stdout
        runs[device] = step_records(dump)
    cpu, dev = runs["cpu"], runs[DEVICE]
    assert sorted(cpu) == sorted(dev) == list(range(1, 21))
    diffs = [abs(dev[s]["loss"] - cpu[s]["loss"]) for s in range(1, 21)]
    norm_diffs = [abs(dev[s]["grad_norm"] - cpu[s]["grad_norm"]) / cpu[s]["grad_norm"] for s in range(1, 21)]
    figure(f"float32 {data}, {DEVICE} vs cpu from one seed: |loss diff| step 1 {diffs[0]:.1e}, max over 20 steps "
           f"{max(diffs):.1e} (step {diffs.index(max(diffs)) + 1}); gradient norm max relative diff "
           f"{max(norm_diffs):.1e}; losses {cpu[1]['loss']:.4f} -> {cpu[20]['loss']:.4f}")
    assert diffs[0] <= STEP_ONE_TOLERANCE, diffs
    assert max(diffs) <= TOLERANCE, diffs
    assert max(norm_diffs) <= TOLERANCE, norm_diffs
