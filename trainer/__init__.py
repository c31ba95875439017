"""A declarative, TOML-driven trainer for Llama models."""

# Every entry point (python -m trainer.train | trainer.launch | trainer.estimate | trainer.hf ...)
# imports this package first: a torch outside the tested range stops here, with one line naming
# the installed version and the range, before any module imports torch.
from trainer.version import require_supported_torch

require_supported_torch()
