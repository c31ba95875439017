"""memory_estimation.disable_fake_mode: the estimate on real tensors, in the job's own ranks.

With memory_estimation.enable and disable_fake_mode, each rank of the started job builds its own
part of the model on its device, runs two training steps of random tokens under the estimator's
memory tracker (trainer/estimate/step_memory.py), logs what the tracker saw beside the device's own
peak (CUDA's allocator; a CPU keeps no such count), frees all of it and then trains from the
start. What the tracker sees is the estimator's model of memory; the device's peak also holds what
it cannot see (the caching allocator's blocks, the communication library's buffers). The steps
draw from their own random state: the run's data and weights are the same as without them.
"""

from __future__ import annotations

import gc
import logging

import torch


logger = logging.getLogger(__name__)

STEPS = 2  # the second step holds the optimizer state the first one creates


def device_peak(device: torch.device) -> int | None:
    """The device allocator's peak since it was last reset (None: a CPU keeps none)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def size(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.2f} MiB"


def estimate_before_training(config, run_plan, mesh, device: torch.device) -> None:
    """With memory_estimation.enable and disable_fake_mode: measure this rank's memory over STEPS
    real steps and log it, leaving nothing allocated."""
    if not (config.memory_estimation.enable and config.memory_estimation.disable_fake_mode):
        return
    from trainer.estimate.rank import RankKind, estimate_rank  # the tracker, only when asked for

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        estimate = estimate_rank(config, run_plan, RankKind("this rank", rank, rank, rank), steps=STEPS,
                                 real_mesh=mesh, device=device)
    peak, step = device_peak(device), estimate.step_peak
    logger.info("memory_estimation (real tensors, %d steps): rank %d tracker peak %s (step: parameters %s, gradients "
                "%s, optimizer %s, activations %s, temporaries %s; initialization %s); %s", STEPS, rank,
                size(estimate.peak), size(step.parameters), size(step.gradients), size(step.optimizer),
                size(step.activations), size(step.temporaries), size(estimate.init_peak.total),
                f"device peak {size(peak)}" if peak is not None else "a CPU keeps no allocator peak to compare")
    del estimate
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
