# warm python: acts the same after the preloaded imports
# (The test suite may run it after the trainer's modules are imported, tests/warm_python: every fault
# patches a class, or a module global that is looked up when it is called.)
"""Injected faults for the protocol's power study, never part of the trainer.

Python imports `sitecustomize` at start-up from the first folder of sys.path that has one. The
power study (benchmarks/protocol_power.py) puts this folder on PYTHONPATH and names a fault in
PROTOCOL_FAULT for the runs that must carry it; every process of such a run then patches the
trainer before it starts. The shipped trainer has no option, variable or code path that enables
any of these: without this folder on PYTHONPATH they do not exist.
"""

import os

if os.environ.get("PROTOCOL_FAULT"):
    from faults_catalog import inject

    inject(os.environ["PROTOCOL_FAULT"])
