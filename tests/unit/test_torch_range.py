"""The supported torch range: pyproject.toml and trainer/version.py agree, and an entry point
started with a torch outside it stops at once with one line naming the version and the range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import version
from trainer.config.manager import tomllib
from trainer.version import TORCH_RANGE, torch_problem, torch_supported

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_range_the_code_checks():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_requirements = [d for d in dependencies if d.replace(" ", "").startswith(("torch>", "torch<", "torch="))]
    assert torch_requirements == [f"torch{TORCH_RANGE}"]
    assert TORCH_RANGE == ">=2.11,<2.14"


def test_releases_in_and_out_of_the_range():
    for inside in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.13.1+cu128"):
        assert torch_supported(inside), inside
    for outside in ("2.10.1", "2.10.0+cu128", "2.14.0", "2.14.0a0+gitabc", "3.0.0", "1.13.1", "", "unknown"):
        assert not torch_supported(outside), outside


def test_the_installed_torch_is_supported():
    import torch

    assert torch_problem() is None, torch.__version__


def test_no_torch_is_named_as_such(monkeypatch):
    monkeypatch.setattr(version, "installed_torch_version", lambda: None)
    assert torch_problem().startswith("torch is not installed (")
    monkeypatch.setattr(version, "installed_torch_version", lambda: "2.10.0+cu126")
    problem = torch_problem()
    assert "torch 2.10.0+cu126 is installed" in problem and "torch>=2.11,<2.14 (2.11, 2.12, 2.13)" in problem


def test_the_version_read_is_torch_dot_version_without_importing_torch():
    # What a run records (torch.__version__), also where the package's metadata says less (PyPI's
    # CUDA wheels: 2.11.0 there, 2.11.0+cu130 in torch.__version__).
    import torch

    done = subprocess.run([sys.executable, "-c", "import sys; from trainer.version import installed_torch_version; "
                           "print(installed_torch_version(), 'torch' in sys.modules)"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [str(torch.__version__), "False"]


@pytest.mark.parametrize("installed", ["2.10.0", "2.14.0"])
@pytest.mark.parametrize("command", [["-m", "trainer.train"], ["-m", "trainer.launch", "--nproc", "1", "--device", "cpu"],
                                     ["-m", "trainer.estimate"], ["-m", "protocol", "plan", "plan.toml"]])
def test_an_entry_point_stops_with_one_line(tmp_path, installed, command):
    # A torch package of version `installed` ahead of the real one on the path; importing it fails,
    # so the entry point must stop on the version alone, before anything imports torch.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the fake torch was imported')\n")
    (fake / "version.py").write_text(f"__version__ = '{installed}'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    # The interpreter that ran it (the suite's own may be a launcher of it: tests/warm_python).
    interpreter = subprocess.run([sys.executable, "-c", "import sys; print(sys.executable)"], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip()
    assert done.stderr.splitlines() == [
        f"error: torch {installed} is installed ({interpreter}); this trainer supports torch>=2.11,<2.14 "
        "(2.11, 2.12, 2.13): install one of those, see README.md, Install"]
