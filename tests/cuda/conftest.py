"""tests/cuda: the trainer on one accelerator, one process (NCCL cannot put two ranks on one GPU).

    TRAINER_TEST_DEVICE=cuda python -m pytest tests/cuda     # on a machine with a GPU
    TRAINER_TEST_DEVICE=cpu  python -m pytest tests/cuda     # the same tests on the CPU: checks their logic

Never part of the default run: tests/conftest.py leaves this folder out unless TRAINER_TEST_DEVICE
is set. With TRAINER_TEST_FIGURES=FILE, the measured figures are also appended to FILE (under
pytest-xdist the end-of-run `measured` section stays in the workers).
"""

from __future__ import annotations

import os

import pytest

from tests.cuda.device import DETERMINISTIC, JOB, dtype_args, train
from tests.launch import describe

DEVICE = os.environ.get("TRAINER_TEST_DEVICE", "")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"TRAINER_TEST_DEVICE={DEVICE!r}: set it to cuda to run tests/cuda on a GPU, or to cpu to "
                            "check the tests' logic on the CPU")
if DEVICE == "cuda":
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"TRAINER_TEST_DEVICE=cuda, but torch {torch.__version__} sees no CUDA device "
                                f"(torch.version.cuda {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})")


@pytest.fixture
def figure(measured):
    """Record a measured figure, tagged with the device, for the end-of-run summary (and the
    TRAINER_TEST_FIGURES file)."""
    def record(line: str) -> None:
        line = f"[{DEVICE}] {line}"
        measured(line)
        path = os.environ.get("TRAINER_TEST_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return record


@pytest.fixture(scope="session")
def eager_bf16(tmp_path_factory):
    """The reference of the feature tests: the job in bfloat16 compute (FSDP over the one rank),
    eager, deterministic; its dump folder. Session-wide: one run per pytest process."""
    dump = tmp_path_factory.mktemp("eager-bf16")
    result = train([*JOB, *DETERMINISTIC, *dtype_args("bfloat16"), "--job.dump_folder", str(dump)])
    assert result.returncode == 0, describe(result)
    return dump
