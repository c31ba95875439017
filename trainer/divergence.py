"""Stopping a run whose training diverged: a non-finite gradient norm after a step, and
non-finite parameters before a save. Both stop every rank together (the values checked are
global), with exit code 3 (trainer.launch.process_exit.DIVERGED): a restart would diverge again from
the same checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor



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


def check_parameters(model: torch.nn.Module, group, device: torch.device, step: int, newest: int | None,
                     clipping: bool) -> None:
    """Before saving step `step`: stop unless every parameter is finite on every rank of `group`
    (None: this process alone). An update can make weights non-finite while the gradient norm was
    finite (a learning rate far too high), and such weights must never be published as a
    checkpoint to resume or start from. Each rank sums the norms of the parameter data it holds
    (a shard, or a whole parameter FSDP left unsharded after a forward pass), and the sums are
    added over the ranks: finite exactly when every value is, however often a value is counted.
    `newest`: the newest checkpoint of the run, for the message."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in (q.detach() for q in model.parameters())]
    local = [t for t in local if t.numel()]
    total = torch.zeros((), dtype=torch.float64, device=device)
    if local:  # .to(device): parameters offloaded to the CPU (training.enable_cpu_offload) sum there
        total += torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).sum().to(device)
    if group is not None:
        dist.all_reduce(total, group=group)
    if not torch.isfinite(total).item():
        raise NonFiniteLossError(
            f"step {step}: the parameters are not finite after the update (a value is NaN or infinite); "
            f"stopped before saving step-{step}, so that no checkpoint holds them ("
            + (f"step-{newest} is the newest" if newest is not None else "no checkpoint of this run was saved")
            + f"). {remedies(clipping).capitalize()}")
