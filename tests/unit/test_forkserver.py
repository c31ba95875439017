"""trainer/forkserver.py: one fork server per process, which imports what each of its users named
before it started."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import REPO

PROGRAM = """
import sys
from trainer.forkserver import preloaded_context

def imported(names):
    return [name in sys.modules for name in names]

if __name__ == "__main__":
    names = ["xml.dom.minidom", "wave"]  # imported by neither this program nor multiprocessing
    first, second = preloaded_context(names[:1]), preloaded_context(names[1:])
    with first.Pool(1) as pool:
        print(first.get_start_method(), pool.apply(imported, (names,)))
"""


def test_the_fork_server_imports_what_every_user_named_before_it_started(tmp_path):
    (tmp_path / "users.py").write_text(PROGRAM)
    done = subprocess.run([sys.executable, "users.py"], cwd=tmp_path, env={"PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "forkserver [True, True]"
