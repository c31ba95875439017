"""torch.compile per transformer block.

Blocks are compiled one by one, in place (`nn.Module.compile`), so parameter names, FSDP units
and pipeline stages do not change, and FSDP's per-block communication stays outside the
compiled graphs. All blocks run the same code on the same shapes, which keeps recompilation low.
"""

from __future__ import annotations

import torch


def apply_compile(model: torch.nn.Module, backend: str) -> None:
    for block in model.layers.values():
        block.compile(backend=backend)
