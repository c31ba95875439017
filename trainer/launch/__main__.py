"""`python -m trainer.launch`: the launcher (trainer/launch/launcher.py)."""

import sys

# First, before the launcher's imports (torch among them): a stop request (SIGUSR1) that arrives
# while they load must not kill the launcher; it is passed on to the ranks, which save and stop.
from trainer.launch import stop_request

stop_request.listen()

from trainer.launch.launcher import main  # noqa: E402

try:
    code = main(sys.argv[1:])
finally:
    stop_request.ignore()  # the run is over: a late stop request must not kill the exiting launcher
sys.exit(code)
