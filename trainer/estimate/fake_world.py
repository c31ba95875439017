"""A world of fake ranks: torch's fake process group plus FakeTensorMode.

Two places in torch do not fit a fake world as they are; both are details of torch, not
computations of the trainer, and are adapted here (only while the estimator runs):
- the pipeline schedule's warm-up vote reads a tensor's value (fake tensors have none): the vote
  is how the stages agree through point-to-point messages whether their shapes are static. Every stage of this trainer is given its shapes
  (trainer.parallel.pipeline.StageShapes), so the answer is "static"; it is asserted, not assumed.
  torch 2.11 has no vote: its schedule's first step sends one float to each neighbour instead, to
  set up the communicators; that once-per-schedule message is left out too, so that the step's
  traffic counts the same messages under 2.11 and 2.13.
- DTensor's sharding propagation creates tensors of the GLOBAL shape to infer output metadata. It
  reuses whatever fake mode is active, so under ours those tensors would be counted as this
  rank's memory; it is given a fake mode of its own, as it has outside the estimator.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process becomes `rank` of `world_size`; every collective succeeds locally."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the estimator needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors():
    """FakeTensorMode, with the two adaptations of the module doc."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _static_pipeline_vote(), _sharding_propagation_in_own_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        yield


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _static_pipeline_vote():
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules._PipelineSchedule, "_warmup_p2p"):
        # torch 2.11, without the vote: its neighbour warm-up (one float each way) is not sent.
        from torch.distributed.pipelining.stage import _PipelineStageBase

        return _patched(_PipelineStageBase, "_get_init_p2p_neighbors_ops", lambda original: lambda self: [])
    from torch.distributed.pipelining._utils import InferenceMode

    def replacement(original):
        def warmup(self, stages, has_backward, p2p_done):
            for stage in stages:
                if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                    raise RuntimeError(f"pipeline stage {stage.stage_index} has no static shapes; the estimator "
                                       "cannot exchange shapes between fake ranks")
                stage._inference_mode = InferenceMode.STATIC
        return warmup

    return _patched(schedules._PipelineSchedule, "_warmup_p2p", replacement)


def _sharding_propagation_in_own_mode():
    """torch 2.13 picks the active fake mode with detect_fake_mode, imported into the sharding
    propagator's module; there it finds none and creates its own (older torch always does)."""
    from torch.distributed.tensor import _sharding_prop

    if not hasattr(_sharding_prop, "detect_fake_mode"):
        return contextlib.nullcontext()
    return _patched(_sharding_prop, "detect_fake_mode", lambda original: lambda *args, **kwargs: None)
