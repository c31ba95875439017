"""The estimator's memory tracker (trainer/estimate/step_memory.py) sees what ring attention
allocates inside its custom op: the op's body runs as plain code under the tracker, where torch's
tracker alone sees only the op's outputs."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from trainer.estimate.step_memory import StepMemory
from trainer.parallel import ring_attention  # noqa: F401 (registers the ops)


def peak_of(tracker: MemTracker, call) -> int:
    with tracker:
        outputs = call()
    del outputs
    return sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def test_ring_attentions_own_allocations_count(one_rank_mesh):
    batch, tokens, heads, dim = 2, 64, 4, 16
    q, k, v = (torch.randn(batch, tokens, h, dim) for h in (heads, 2, 2))
    # Two documents per sequence: the chunk pairs need masks (boolean and additive, chunk x chunk).
    documents = (torch.arange(tokens) >= tokens // 3).long().expand(batch, tokens).contiguous()
    group = one_rank_mesh.get_group().group_name

    def call():
        return torch.ops.trainer.ring_attention(q, k, v, documents, group, 0, 1, None)

    outputs_only, opened = peak_of(MemTracker(), call), peak_of(StepMemory(), call)
    out, lse = call()
    assert outputs_only == out.numel() * 4 + lse.numel() * 4  # what torch's tracker sees: the outputs
    chunk = tokens // 2
    masks = batch * chunk * chunk * (1 + 4)  # one pair's boolean and float32 additive masks
    assert opened >= outputs_only + masks
