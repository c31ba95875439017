"""`python -m trainer.preflight`: check a run's configuration without starting it (trainer/preflight/checks.py)."""

import sys

from trainer.preflight.checks import main

sys.exit(main(sys.argv[1:]))
