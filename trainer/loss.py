"""The one loss definition (ARCHITECTURE invariant 2).

loss = (sum of token cross-entropies over the global batch) / (target tokens in the global batch)

Each rank and microbatch contributes its cross-entropy SUM divided by the GLOBAL token count, and
data-parallel gradients are summed, not averaged. The result does not depend on how the global
batch is split over ranks, microbatches or accumulation steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in float32; labels equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
