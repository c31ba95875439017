"""The [activation_checkpoint] and [compile] sections: how blocks are recomputed and compiled.

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.config.ranges import valid


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """none, full (every block), selective (see selective_ac_option), or memory_budget (torch's
    compiler chooses what each compiled block recomputes; needs compile.enable with 'model' in
    compile.components and the inductor backend; see memory_budget)."""

    selective_ac_option: str = "2"
    """With mode selective: an integer N checkpoints every N-th block; 'op' saves selected ops."""

    memory_budget: float = valid(0.5, ge=0, le=1)
    """With mode memory_budget: the share of a compiled block's activations its forward keeps
    for backward, from 0.0 (about what mode full keeps) to 1.0 (what no checkpointing keeps);
    torch's partitioner recomputes the cheapest rest."""


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = False
    """Compile each transformer block (and the loss) with torch.compile."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model, loss."""

    backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = "inductor"
    """torch.compile backend: inductor (generated kernels: the one for speed), aot_eager and eager
    (traced but run by torch's own kernels: for finding whether a problem is the compiler's),
    cudagraphs (CUDA only)."""
