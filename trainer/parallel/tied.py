"""Tied input and output embeddings across pipeline stages.

A tied model (Llama 3.2 1B and 3B) uses one matrix as the token embedding (first stage) and as
the output projection (last stage). Under pipeline parallelism the two stages live on different
ranks, so each holds a copy, named tok_embeddings.weight on both: initialized from the same
(seed, name), loaded from the same checkpoint key. After backward the copies' gradients are
summed over a two-rank group (the ranks holding the first and the last stage, one group per
data/tensor/context-parallel coordinate), so both hold the gradient of the one tied weight and
the same optimizer update keeps them equal. The gradient norm counts the last stage's copy out.

V-shaped schedules put the first and the last stage on the same rank; tying is refused with them
(trainer/parallel/dims.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def pipeline_pairs(world_mesh, first_pp_rank: int, last_pp_rank: int) -> list[list[int]]:
    """For every pipeline (a line of the mesh along "pp"): [its first-stage rank, its last-stage rank]."""
    names = list(world_mesh.mesh_dim_names)
    ranks = world_mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, world_mesh.mesh.shape[names.index("pp")])
    return [[int(line[first_pp_rank]), int(line[last_pp_rank])] for line in ranks]


class TiedEmbeddings:
    """Sums the gradients of the tied embedding's copies on the first and the last pipeline stage."""

    def __init__(self, stages: dict[int, torch.nn.Module], plan, world_mesh):
        first, last = plan.rank_of_stage(0), plan.rank_of_stage(plan.num_stages - 1)
        assert first != last, "tied embeddings with the first and last stage on one rank are refused at preflight"
        # Every rank creates every group (torch requires it), and joins its own pipeline's pair.
        self.group, _ = dist.new_subgroups_by_enumeration(pipeline_pairs(world_mesh, first, last))
        held = [stage.tok_embeddings.weight for stage in stages.values() if stage.tok_embeddings is not None]
        self.weight = held[0] if held else None
        # The copy the global gradient norm leaves out: the last stage's (the first stage's counts).
        self.norm_duplicate = self.weight if self.weight is not None and 0 not in stages else None

    @torch.no_grad()
    def sum_gradients(self) -> None:
        if self.weight is None:
            return
        if self.weight.grad is None:  # this copy was not used this step: it adds nothing
            self.weight.grad = torch.zeros_like(self.weight)
        grad = self.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.group)
