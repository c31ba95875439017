"""A one-machine SLURM cluster for the real-controller tests (tests/slurm/cluster.sh).

Where slurmctld, slurmd and munge are missing, they are installed when this runs as root; elsewhere
the tests are skipped with the reason, unless PROTOCOL_REQUIRE_SLURM=1 (CI sets it) makes that a
failure. The daemons run for the tests of a module, with their state in a temporary folder, and are
stopped by their PIDs after them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).with_name("cluster.sh")
REQUIRED = os.environ.get("PROTOCOL_REQUIRE_SLURM") == "1"


def unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"PROTOCOL_REQUIRE_SLURM=1, but the SLURM cluster cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """SLURM_CONF of a running one-machine cluster whose node declares 16 CPUs."""
    if os.geteuid() != 0:
        unavailable("the one-machine SLURM cluster needs root (slurmd starts the jobs)")
    if not all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch")):
        installed = subprocess.run(["bash", str(CLUSTER), "install"], capture_output=True, text=True, timeout=600)
        if installed.returncode:
            unavailable(f"installing SLURM failed: {installed.stderr.strip()[-800:]}")
    folder = tmp_path_factory.mktemp("slurm-cluster")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(folder), "16"], capture_output=True, text=True,
                             timeout=120)
    try:
        if started.returncode:
            unavailable(f"the cluster did not start: {started.stderr.strip()[-2000:]}")
        yield folder / "slurm.conf"
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=120)
