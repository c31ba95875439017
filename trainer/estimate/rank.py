"""One rank's estimate: the trainer's own code at full scale, on fake tensors in a fake world."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from trainer.estimate.fake_world import fake_process_group, fake_tensors
from trainer.estimate.step_memory import MemoryBreakdown, StepMemory
from trainer.model_build import build_on_meta, materialize, training_model_args
from trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from trainer.parallel.collectives import CollectiveCounter, mesh_group_names
from trainer.step import StepRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateBytes:
    """What a rank keeps between steps, counted exactly from its tensors (local shards)."""

    parameters: int
    gradients: int  # after backward, before the optimizer step frees them
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class RankKind:
    """Ranks that hold the same parts of the model (the same pipeline stages): one estimate
    stands for all of them (FSDP, TP and CP shards differ at most by FSDP's padding)."""

    name: str
    rank: int  # the one estimated
    first: int  # the global ranks it stands for: first..last
    last: int
    stages: tuple[int, ...] = ()

    @property
    def ranks(self) -> str:
        return f"{self.first}-{self.last}" if self.last > self.first else str(self.first)

    def __contains__(self, rank: int) -> bool:
        return self.first <= rank <= self.last


@dataclass
class RankEstimate:
    kind: RankKind
    parameter_count: int  # parameters this rank holds (local shards)
    state: StateBytes
    init_peak: MemoryBreakdown  # while materializing and drawing the initial weights
    step_peak: MemoryBreakdown
    collectives: dict = field(default_factory=dict)  # {dimension: {op: {"calls", "bytes"}}} of one step
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        return max(self.init_peak.total, self.step_peak.total)


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Parameters, gradients and optimizer state of this rank (shared parameters counted once)."""
    params = list(model.parameters())
    optimizer_bytes = sum(local_bytes(value) for state in optimizer.state.values() for value in state.values()
                          if torch.is_tensor(value))
    return StateBytes(parameters=sum(local_bytes(p) for p in params),
                      gradients=sum(local_bytes(p.grad) for p in params if p.grad is not None),
                      optimizer=optimizer_bytes)


def rank_kinds(dims, stage_plan) -> list[RankKind]:
    """Without pipeline parallelism every rank holds the same; with it, the first, a middle and
    the last pipeline rank (the pp coordinate is the outermost, so each holds a block of ranks)."""
    if stage_plan is None:
        return [RankKind("every rank", 0, 0, dims.world_size - 1)]
    per_pp_rank = dims.world_size // dims.pp
    chosen = [("first", 0), ("middle", dims.pp // 2), ("last", dims.pp - 1)]
    if dims.pp == 2:  # no rank between the first and the last
        del chosen[1]
    return [RankKind(f"{name} pipeline rank ({pp_rank})", pp_rank * per_pp_rank, pp_rank * per_pp_rank,
                     (pp_rank + 1) * per_pp_rank - 1, tuple(stage_plan.stages_of_rank(pp_rank)))
            for name, pp_rank in chosen]


def fake_batch(config, accumulation_steps: int, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's microbatches of one global batch, as the loader gives them (token ids)."""
    shape = (config.training.local_batch_size, config.training.seq_len)
    vocab = training_model_args(config).vocab_size
    return [(torch.randint(0, vocab, shape, device=device), torch.randint(0, vocab, shape, device=device))
            for _ in range(accumulation_steps)]


def estimate_rank(config, run_plan, kind: RankKind, steps: int = 1, real_mesh=None,
                  device: torch.device = torch.device("cpu")) -> RankEstimate:
    """Build rank `kind.rank` of the configured job and run `steps` training steps on fake tensors
    in a fake world; the collectives are counted over the last step. With `real_mesh` (this
    process's rank of a running job), on real tensors on `device` instead (real.py)."""
    started = time.perf_counter()
    dims, fake = run_plan.dims, real_mesh is None
    with fake_process_group(kind.rank, dims.world_size) if fake else contextlib.nullcontext():
        mesh = dims.build_mesh(device.type) if fake else real_mesh
        model_args = training_model_args(config)
        parallel = build_on_meta(config, dims, mesh, device, model_args)
        with fake_tensors() if fake else contextlib.nullcontext():
            with StepMemory() as init_memory:
                materialize(parallel, config.debug.seed, device)
            runner = StepRunner(parallel, run_plan, mesh, config, device)
            if config.training.document_masking:
                runner.document_eos = model_args.vocab_size - 1
            optimizer = build_optimizer(parallel.model.named_parameters(), config.optimizer)
            scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
            step_memory = StepMemory()
            step_memory.track_external(parallel.model, optimizer)
            with step_memory:
                for step in range(1, steps + 1):
                    counter = CollectiveCounter(mesh_group_names(mesh)) if step == steps else None
                    state = run_training_step(runner, parallel.model, optimizer, scheduler, config, run_plan, counter,
                                              device)
    return RankEstimate(
        kind=kind, parameter_count=sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                       for p in parallel.model.parameters()),
        state=state, init_peak=init_memory.peak(), step_peak=step_memory.peak(),
        collectives=counter.per_op(), seconds=time.perf_counter() - started)


def run_training_step(runner, model, optimizer, scheduler, config, run_plan, counter, device=None) -> StateBytes:
    """What Trainer.train_step does with a batch (the update of a float16 run is taken as finite:
    its loss scaler decides on values, which fake tensors do not have)."""
    with counter if counter is not None else contextlib.nullcontext():
        batch = fake_batch(config, run_plan.accumulation_steps, device)
        if counter is not None:
            counter.phase = "forward"
        runner.forward_backward(batch)
        state = state_bytes(model, optimizer)
        if counter is not None:
            counter.phase = "update"
        clip_grad_norm(model.parameters(), config.training.max_norm, runner.norm_reduction())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return state
