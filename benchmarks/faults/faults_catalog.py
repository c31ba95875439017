"""Real parallelism bugs, written as patches of the trainer (see sitecustomize.py for how they
are switched on). Each is a mistake a parallel implementation can plausibly make, and each one
leaves a run that trains and logs normally: only the convergence protocol can tell.

* tp_norm_grad_unreduced: under tensor (sequence) parallelism each TP rank sees its own tokens,
  so the gradient of a replicated RMSNorm weight is a partial sum; this bug skips its all-reduce
  and every TP rank updates its copy with its own partial gradient (the copies drift apart).
* cp_rope_unshifted: under context parallelism each rank rotates its queries and keys as if its
  chunk started at position 0 (the ring's masks still use the true positions), so relative
  positions between chunks are wrong.
* cp_rope_tail_misplaced: under load-balanced context parallelism rank r holds chunks r and
  2cp-1-r of 2cp; this bug rotates the second (tail) chunk as if it were chunk cp+r, so the two
  tail chunks of cp 2 swap their RoPE positions (the ring's masks still use the true positions).
* cp_kv_grad_unreduced: under context parallelism every rank's keys and values travel the ring
  to the queries of the others; in backward their gradient shares must be summed on the way back
  to the rank that owns them. This bug drops the sum carried so far at each hop, so an owner
  receives one other rank's share only and the key and value projections miss the rest.
* norm_counts_replicas: the global gradient norm counts a TP-replicated gradient once per TP rank
  instead of once, so the logged norm (and clipping, when it is active) is wrong while the
  gradients themselves are right.
"""

from __future__ import annotations

import sys


def tp_norm_grad_unreduced() -> None:
    from torch.distributed.tensor import DTensor, Replicate

    from trainer.parallel import tensor

    def backward(ctx, grad):
        if all(p.is_replicate() for p in grad.placements):
            return grad, None
        replicated = [Replicate()] * grad.device_mesh.ndim
        return DTensor.from_local(grad.to_local(), grad.device_mesh, replicated, run_check=False), None

    tensor.ReduceGradient.backward = staticmethod(backward)


def cp_rope_unshifted() -> None:
    import torch

    from trainer.parallel import context

    def positions(self, local_len, device):
        return torch.arange(local_len, device=device)

    context.ContextParallelAttention.positions = positions


def cp_rope_tail_misplaced() -> None:
    import torch

    from trainer.parallel import context

    def positions(self, local_len, device):
        chunk = local_len // 2
        head = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=device)
        tail = torch.arange((self.degree + self.rank) * chunk, (self.degree + self.rank + 1) * chunk, device=device)
        return torch.cat([head, tail])

    context.ContextParallelAttention.positions = positions


def cp_kv_grad_unreduced() -> None:
    from trainer.parallel import ring_attention

    ring_attention.add_partial = lambda arrived, own: own


def norm_counts_replicas() -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from trainer import optim

    def local_squared_norm(grads, ranks_per_stage):
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not local:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).square().sum()

    optim.local_squared_norm = local_squared_norm


FAULTS = {f.__name__: f for f in (tp_norm_grad_unreduced, cp_rope_unshifted, cp_rope_tail_misplaced,
                                   cp_kv_grad_unreduced, norm_counts_replicas)}


def inject(name: str) -> None:
    if name not in FAULTS:
        sys.exit(f"PROTOCOL_FAULT={name!r}: unknown fault; known: {', '.join(FAULTS)}")
    FAULTS[name]()
