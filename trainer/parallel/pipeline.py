"""Pipeline parallelism with torch.distributed.pipelining.

The model built on the meta device is cut into stages by layer (trainer/parallel/stages.py says
which blocks each stage holds and which PP rank runs it). A stage is a copy of the Llama with the
modules it does not own removed, so its parameters keep their original names: checkpoints,
initialization and the optimizer see the same names whatever the pipeline layout.

The schedule runs the microbatches of one optimizer step (the local batches of all its
gradient-accumulation steps, one after the other) through the stages in one schedule step and
calls the loss on the last stage for each microbatch. The loss of a microbatch is its
cross-entropy sum divided by the global token count (invariant 2), so the schedule must not
scale gradients again (scale_grads=False), and the sum of the microbatch losses is this rank's
share of the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from trainer.parallel.stages import SINGLE_STAGE_SCHEDULES, StagePlan


def split_into_stages(model: nn.Module, plan: StagePlan, pp_rank: int) -> dict[int, nn.Module]:
    """stage index -> copy of `model` (on the meta device) holding only that stage's modules."""
    return {stage: model.pipeline_stage({str(b) for b in plan.blocks[stage]}, first=stage == 0,
                                        last=stage == plan.num_stages - 1)
            for stage in plan.stages_of_rank(pp_rank)}


class RankModel(nn.Module):
    """Every module this PP rank holds, under its original name: the stages' modules, shared (no
    copy). The optimizer, checkpoints and gradient clipping use it; the schedule runs the stages."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.args = stages[0].args
        self.tok_embeddings = next((s.tok_embeddings for s in stages if s.tok_embeddings is not None), None)
        blocks = sorted(((name, block) for s in stages for name, block in s.layers.items()), key=lambda nb: int(nb[0]))
        self.layers = nn.ModuleDict(blocks)
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.output = next((s.output for s in stages if s.output is not None), None)


class MicrobatchLoss:
    """The loss the schedule calls on the last stage: cross-entropy sum / global target tokens.
    The denominator changes every step, so the trainer sets it before running the schedule."""

    def __init__(self, cross_entropy_sum: Callable):
        self.cross_entropy_sum = cross_entropy_sum
        self.denominator: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_sum(logits, labels) / self.denominator


@dataclass(frozen=True)
class StageShapes:
    """What one microbatch looks like between stages, known from the config: torch's stages then
    skip their metadata exchange with their neighbours (static mode), and the receive buffers are
    allocated from these shapes."""

    microbatch: int  # sequences per pipeline microbatch
    tokens: int  # tokens of each sequence this rank holds (training.seq_len / context-parallel degree)
    hidden_tokens: int  # of those, in the hidden state between stages (/ TP degree under sequence parallelism)
    dim: int
    vocab: int  # columns of the last stage's logits (a vocabulary-sharded DTensor has the global shape)
    dtype: torch.dtype  # of the hidden state and the logits (the compute dtype)

    def of_stage(self, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of a stage as meta tensors."""
        # The hidden state carries a gradient back; torch reads that from requires_grad.
        hidden = torch.empty(self.microbatch, self.hidden_tokens, self.dim, dtype=self.dtype, device="meta",
                             requires_grad=True)
        tokens = torch.empty(self.microbatch, self.tokens, dtype=torch.long, device="meta")
        logits = torch.empty(self.microbatch, self.tokens, self.vocab, dtype=self.dtype, device="meta")
        return (tokens if stage == 0 else hidden), (logits if stage == num_stages - 1 else hidden)


def without_self_warmup(stage: PipelineStage) -> PipelineStage:
    """`stage`, leaving out the warm-up messages it would send to its own rank.

    torch 2.11's multi-stage schedules first exchange a dummy tensor between every two
    neighbouring stages to open their point-to-point links, also when both stages are on this
    rank (the V-shaped schedules, ZBVZeroBubble and DualPipeV, put stages 1 and 2 on one rank):
    gloo cannot send to its own rank ("Pair is not connected"). Such a message opens no link, so
    it is dropped (its send and its receive both). torch 2.13 warms the links up another way and
    never calls this method for these stages."""
    make_ops = stage._get_init_p2p_neighbors_ops

    def warmup_ops():
        return [op for op in make_ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = warmup_ops
    return stage


class Pipeline:
    """The stages of this PP rank and the schedules that drive them.

    Training runs every pipeline microbatch of an optimizer step, from all its accumulation steps,
    in one schedule step (`n_microbatches` of them), so the bubble and FSDP's gradient reduction
    (reduce-scatter, and the all-reduce across replicas under HSDP and DDP) come once per step.
    Validation runs one local batch at a time: when that is fewer microbatches than a training
    step, it gets a schedule of its own over the same modules (torch's stages keep per-microbatch
    buffers, so a schedule and its stages serve one microbatch count)."""

    def __init__(self, stages: dict[int, nn.Module], plan: StagePlan, pp_mesh, device: torch.device,
                 n_microbatches: int, loss: MicrobatchLoss, shapes: StageShapes):
        self.plan, self.loss, self.shapes = plan, loss, shapes
        self.modules, self.group, self.device = stages, pp_mesh.get_group(), device
        self.has_first_stage = 0 in stages
        self.has_last_stage = plan.num_stages - 1 in stages
        self.n_microbatches = n_microbatches
        self.schedule = self._build_schedule(n_microbatches)
        self._schedules = {n_microbatches: self.schedule}  # microbatch count -> schedule

    def _build_schedule(self, n_microbatches: int):
        plan = self.plan
        pipeline_stages = []
        for index, module in sorted(self.modules.items()):
            inputs, outputs = self.shapes.of_stage(index, plan.num_stages)
            stage = PipelineStage(module, index, plan.num_stages, self.device, input_args=inputs,
                                  output_args=outputs, group=self.group)
            pipeline_stages.append(without_self_warmup(stage))
        schedule_class = get_schedule_class(plan.schedule)
        owned = pipeline_stages[0] if plan.schedule in SINGLE_STAGE_SCHEDULES else pipeline_stages
        schedule = schedule_class(owned, n_microbatches=n_microbatches, loss_fn=self.loss, scale_grads=False)
        assert isinstance(schedule, PipelineScheduleSingle) == (plan.schedule in SINGLE_STAGE_SCHEDULES)
        return schedule

    def _schedule_for(self, rows: int):
        n = rows // self.shapes.microbatch
        if rows % self.shapes.microbatch or n < 1:
            raise ValueError(f"{rows} sequences are not whole pipeline microbatches of {self.shapes.microbatch}")
        if n not in self._schedules:
            self._schedules[n] = self._build_schedule(n)
        return self._schedules[n]

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, denominator) -> torch.Tensor:
        self.loss.denominator = denominator
        losses: list[torch.Tensor] = []
        # Contiguous: torch 2.11's stage checks its inputs' strides against the declared (contiguous)
        # shapes and refuses the loader's view (torch 2.13 does not); training's are already (joined).
        args = (inputs.contiguous(),) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        run(*args, target=target, losses=losses if self.has_last_stage else None)
        total = torch.zeros((), device=labels.device)
        for loss in losses:
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        return total

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, denominator) -> torch.Tensor:
        """Train on the local batches of one optimizer step, concatenated along the batch dimension
        (`n_microbatches` pipeline microbatches, in one schedule step); returns the sum of their
        microbatch losses on the rank with the last stage, zero elsewhere."""
        if labels.shape[0] != self.n_microbatches * self.shapes.microbatch:
            raise ValueError(f"the pipeline trains on {self.n_microbatches} microbatches of {self.shapes.microbatch} "
                             f"sequences per step, got {labels.shape[0]} sequences")
        return self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), inputs, labels, denominator)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy sum of one local batch (forward only), on the rank with the last stage."""
        return self._run(self._schedule_for(labels.shape[0]).eval, inputs, labels, 1.0)
