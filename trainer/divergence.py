"""Stopping a run whose training diverged: a non-finite gradient norm after a step, and
non-finite parameters before a save. Both stop every rank together (the values checked are
global), with exit code 3 (trainer.process_exit.DIVERGED): a restart would diverge again from
the same checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.optim import local_squared_norm


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or a parameter became NaN or infinite."""


def remedies(clipping: bool, *more: str) -> str:
    """What to try, naming clipping only when training.max_norm does not clip already."""
    found = ["lower optimizer.lr", *more] + ([] if clipping else ["enable training.max_norm clipping"])
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def check_gradient_norm(step: int, grad_norm: torch.Tensor, loss: float, clipping: bool) -> None:
    """Stop on a NaN/inf gradient norm. The norm is global, so every rank sees a NaN/inf from any
    rank and all stop together. `clipping`: training.max_norm clips the gradients."""
    if not torch.isfinite(grad_norm).item():
        raise NonFiniteLossError(f"step {step}: loss {loss}, gradient norm {grad_norm.item()}; stopping "
                                 f"({remedies(clipping, 'check the data')})")


def check_parameters(model: torch.nn.Module, reduction, device: torch.device, step: int, newest: int | None,
                     clipping: bool) -> None:
    """Before saving step `step`: stop unless every parameter is finite on every rank. An update
    can make weights non-finite while the gradient norm was finite (a learning rate far too high),
    and such weights must never be published as a checkpoint to resume or start from. `reduction`
    is the step runner's norm reduction (its group and ranks per pipeline stage); `newest` the
    newest checkpoint of the run, for the message."""
    # .to(device): parameters offloaded to the CPU (training.enable_cpu_offload) sum there
    squares = local_squared_norm([p.detach() for p in model.parameters()], reduction.ranks_per_stage).to(device)
    if reduction.group is not None:
        dist.all_reduce(squares, group=reduction.group)
    if not torch.isfinite(squares).item():
        raise NonFiniteLossError(
            f"step {step}: the parameters are not finite after the update (their norm is {squares.sqrt().item()}); "
            f"stopped before saving step-{step}, so that no checkpoint holds them ("
            + (f"step-{newest} is the newest" if newest is not None else "no checkpoint of this run was saved")
            + f"). {remedies(clipping).capitalize()}")
