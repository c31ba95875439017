"""`python -m protocol`: the same as the `protocol` console script."""

import sys

from protocol.cli import main

sys.exit(main())
