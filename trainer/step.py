"""Forward and backward of one global batch under the configured parallelisms.

Whatever the layout, a step computes the loss of ARCHITECTURE invariant 2: each rank adds the
cross-entropy sums of its tokens divided by the number of target tokens of the whole global batch.
Context-parallel ranks first keep their part of every sequence; the pipeline, when there is one,
runs the microbatches of all accumulation steps through the stages in one schedule step; a
vocabulary-sharded loss runs inside loss_parallel.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainer.loss import count_targets, cross_entropy_sum
from trainer.models.llama3.model import document_index
from trainer.optim import NormReduction
from trainer.parallel.compile import compile_loss
from trainer.parallel.context_parallel import shard_sequence
from trainer.parallel.fsdp import resolve_param_dtype
from trainer.parallel.pipeline import MicrobatchLoss, Pipeline, StageShapes
from trainer.parallel.tensor import loss_context
from trainer.parallel.tied import TiedEmbeddings

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def stage_shapes(config, dims, args, device: torch.device) -> StageShapes:
    """The shapes between pipeline stages of this layout: the hidden state is sequence-sharded
    over the TP ranks (sequence parallelism) and computed in the FSDP compute dtype."""
    tokens = config.training.seq_len // dims.cp
    return StageShapes(
        microbatch=config.parallelism.pipeline_parallel_microbatch_size, tokens=tokens,
        hidden_tokens=tokens // dims.tp, dim=args.dim, vocab=args.vocab_size,
        dtype=resolve_param_dtype(config.training.mixed_precision_param, device))


class StepRunner:
    def __init__(self, parallel, plan, mesh, config, device: torch.device):
        """`plan`: the run's trainer.preflight.checks.RunPlan (its degrees and accumulation steps)."""
        dims, p = plan.dims, config.parallelism
        self.model = parallel.model
        self.device = device
        self.cp, self.cp_rank = dims.cp, mesh["cp"].get_local_rank()
        self.loss_group = mesh["dp_cp"].get_group()  # ranks holding different tokens of the batch
        self.pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
        self.pp_degree = dims.pp
        self.loss_parallel = dims.tp > 1 and not p.disable_loss_parallel
        loss_compiled = config.compile.enable and "loss" in config.compile.components
        self.cross_entropy_sum = compile_loss(cross_entropy_sum, config.compile.backend) if loss_compiled \
            else cross_entropy_sum
        # Gradient accumulation: the all-reduce across replicas (HSDP, DDP) runs once, after the
        # last microbatch; see `_all_reduce_only_after` (under PP the one schedule step does it).
        self.replicated_roots = [stage for stage in parallel.stages.values() if isinstance(stage, FSDPModule)] \
            if dims.dp_replicate > 1 else []
        # Document masking (training.document_masking): the EOS id that ends each document.
        # Pipeline parallelism is refused with it (the stages after the first see no tokens).
        self.document_eos: int | None = None
        self.pipeline = None
        self.tied = None  # the tied embedding's copies on the first and last pipeline stage
        if parallel.stage_plan is not None and self.model.args.tie_embeddings:
            self.tied = TiedEmbeddings(parallel.stages, parallel.stage_plan, mesh.world)
        if parallel.stage_plan is not None:
            # One schedule step per optimizer step: the pipeline microbatches of every accumulation step.
            n_microbatches = (config.training.local_batch_size // p.pipeline_parallel_microbatch_size
                              * plan.accumulation_steps)
            self.pipeline = Pipeline(parallel.stages, parallel.stage_plan, mesh["pp"], device, n_microbatches,
                                     MicrobatchLoss(self._loss_sum), stage_shapes(config, dims, self.model.args, device))

    def _loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.cross_entropy_sum(logits, labels)
        # A vocabulary-sharded loss comes back as a DTensor replicated over the TP ranks.
        return loss.to_local() if hasattr(loss, "to_local") else loss

    def _local_tokens(self, microbatches: Microbatches) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(inputs, labels) of this rank's part of each sequence, with the whole sequence's
        document indices (None unless document masking is on)."""
        local = []
        for inputs, labels in microbatches:
            documents = None if self.document_eos is None else document_index(inputs, self.document_eos)
            if self.cp > 1:
                inputs, labels = shard_sequence(inputs, self.cp_rank, self.cp), shard_sequence(labels, self.cp_rank, self.cp)
            local.append((inputs, labels, documents))
        return local

    def forward_backward(self, microbatches: Microbatches, loss_scale: float | None = None) -> torch.Tensor:
        """Accumulate the gradients of the global loss (times `loss_scale` when float16 needs it,
        see trainer.loss_scale); returns this rank's share of the unscaled loss (the shares of
        all ranks sum to the global loss, see `global_sum`)."""
        microbatches = self._local_tokens(microbatches)
        global_targets = sum(count_targets(labels) for _, labels, _ in microbatches).float()
        dist.all_reduce(global_targets, group=self.loss_group)
        # Scaling the denominator scales every microbatch's loss and gradient by loss_scale.
        denominator = global_targets if loss_scale is None else global_targets / loss_scale
        share = torch.zeros((), device=self.device)
        with loss_context(self.loss_parallel):
            if self.pipeline is not None:
                share += self._pipeline_forward_backward(microbatches, denominator)
            else:
                for index, (inputs, labels, documents) in enumerate(microbatches):
                    with self._all_reduce_only_after(last=index == len(microbatches) - 1):
                        loss = self._loss_sum(self.model(inputs, documents), labels) / denominator
                        loss.backward()
                        share += loss.detach()
        if self.tied is not None:
            self.tied.sum_gradients()
        return share if loss_scale is None else share / loss_scale

    def _pipeline_forward_backward(self, microbatches, denominator) -> torch.Tensor:
        """All accumulation steps in one schedule step: their local batches, one after the other
        along the batch dimension, are cut into the same pipeline microbatches as each alone, each
        with the loss of invariant 2; the bubble and FSDP's gradient reduction (the all-reduce
        across replicas included) come once per optimizer step, not once per accumulation step.
        Document masking is refused under PP (the later stages never see the tokens): no indices."""
        assert all(documents is None for _, _, documents in microbatches)
        inputs = torch.cat([inputs for inputs, _, _ in microbatches])
        labels = torch.cat([labels for _, labels, _ in microbatches])
        return self.pipeline.forward_backward(inputs, labels, denominator)

    @contextlib.contextmanager
    def _all_reduce_only_after(self, last: bool):
        """Under HSDP and DDP, skip the all-reduce across replicas for all but the last microbatch
        of a step: FSDP keeps adding the (shard-reduced) gradients of the earlier microbatches and
        all-reduces their sum once. Within a shard group the reduce-scatter still runs per
        microbatch, so gradients stay sharded in memory (FSDP alone has no all-reduce to skip)."""
        if last or not self.replicated_roots:
            yield
            return
        for root in self.replicated_roots:
            root.set_requires_all_reduce(False)
        try:
            yield
        finally:
            for root in self.replicated_roots:
                root.set_requires_all_reduce(True)

    @torch.no_grad()
    def evaluate(self, microbatches: Microbatches) -> torch.Tensor:
        """(cross-entropy sum, target tokens) of these microbatches, summed over all ranks."""
        microbatches = self._local_tokens(microbatches)
        totals = torch.zeros(2, device=self.device)
        with loss_context(self.loss_parallel):
            for inputs, labels, documents in microbatches:
                if self.pipeline is not None:
                    totals[0] += self.pipeline.evaluate(inputs, labels)
                else:
                    totals[0] += self._loss_sum(self.model(inputs, documents), labels)
                totals[1] += count_targets(labels)
        if self.pp_group is not None:
            totals[0] = self._pipeline_sum(totals[0])
        dist.all_reduce(totals, group=self.loss_group)
        return totals

    def _pipeline_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Under PP the loss lives on the rank with the last stage: add it up over the pipeline."""
        value = value.clone()
        dist.all_reduce(value, group=self.pp_group)
        return value

    def global_sum(self, share: torch.Tensor) -> float:
        """The sum over all ranks of a per-rank loss share: the global loss."""
        total = self._pipeline_sum(share) if self.pp_group is not None else share.clone()
        dist.all_reduce(total, group=self.loss_group)
        return total.item()

    def norm_reduction(self) -> NormReduction:
        """How the global gradient norm is reduced: over every rank at once (see optim.clip_grad_norm)."""
        if dist.get_world_size() == 1:
            return NormReduction()
        duplicate = self.tied.norm_duplicate if self.tied is not None else None
        return NormReduction(group=dist.group.WORLD, ranks_per_stage=dist.get_world_size() // self.pp_degree,
                             duplicates=(duplicate,) if duplicate is not None else ())
