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
* fsdp_grad_averaged: FSDP's gradient reduce-scatter over the shard dimension averages instead of
  summing (torch's default divide factor, where this trainer's loss is already divided by the
  global token count): every gradient is 1/dp_shard of what it should be. Adam's updates barely
  change (they are nearly scale-free), so the loss curve hides it for long.
* tp_rope_half_keys: under tensor parallelism each rank holds a slice of the key heads; the second
  TP rank rotates its keys at positions offset by its share of the sequence (rank x seq_len / tp,
  the offset sequence parallelism gives a rank's tokens, applied to a tensor split by heads), so
  half of the key heads see every query half a sequence away.
* tp_w2_grad_doubled_in_one_block: one TP rank doubles the weight gradient of one parameter of
  one block (layers.2.feed_forward.w2), as a wrong scale applied to a single parameter would.
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

    from trainer.parallel import context_parallel

    def positions(self, local_len, device):
        return torch.arange(local_len, device=device)

    context_parallel.ContextParallelAttention.positions = positions


def cp_rope_tail_misplaced() -> None:
    import torch

    from trainer.parallel import context_parallel

    def positions(self, local_len, device):
        chunk = local_len // 2
        head = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=device)
        tail = torch.arange((self.degree + self.rank) * chunk, (self.degree + self.rank + 1) * chunk, device=device)
        return torch.cat([head, tail])

    context_parallel.ContextParallelAttention.positions = positions


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


def fsdp_grad_averaged() -> None:
    from torch.distributed.fsdp import FSDPModule

    from trainer.parallel import fsdp

    original = fsdp.apply_fsdp

    def apply_fsdp(model, mesh, **kwargs):
        original(model, mesh, **kwargs)
        shards = mesh.size(mesh.ndim - 1)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(shards))

    fsdp.apply_fsdp = apply_fsdp


def tp_w2_grad_doubled_in_one_block() -> None:
    import torch

    from trainer.parallel import tensor

    class DoubleGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    original = tensor.apply_tp

    def apply_tp(model, tp_mesh, **kwargs):
        parts = original(model, tp_mesh, **kwargs)  # what the blocks' runtime needs: passed on
        if "2" in model.layers and tp_mesh.get_local_rank() == 1:
            w2 = model.layers["2"].feed_forward.w2
            cast = w2.cast
            w2.cast = lambda weight: cast(DoubleGradient.apply(weight))
        return parts

    tensor.apply_tp = apply_tp


def tp_rope_half_keys() -> None:
    from trainer.models.llama3 import model as llama
    from trainer.parallel import tensor

    original = tensor.apply_tp

    def apply_tp(model, tp_mesh, **kwargs):
        parts = original(model, tp_mesh, **kwargs)  # what the blocks' runtime needs: passed on
        if tp_mesh.get_local_rank() == 1:
            for block in model.layers.values():
                block.attention.keys_offset_by_half = True
        return parts

    def forward(self, x, rope, documents=None):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        positions = self.core.positions(seq, rope.device)
        shifted = (positions + seq // 2) % rope.shape[0]
        key_positions = shifted if getattr(self, "keys_offset_by_half", False) else positions
        out = self.core(llama.apply_rope(q, rope[positions]), llama.apply_rope(k, rope[key_positions]), v, documents)
        return self.wo(out.reshape(batch, seq, -1))

    tensor.apply_tp = apply_tp
    llama.Attention.forward = forward


FAULTS = {f.__name__: f for f in (tp_norm_grad_unreduced, cp_rope_unshifted, cp_rope_tail_misplaced,
                                   cp_kv_grad_unreduced, norm_counts_replicas, fsdp_grad_averaged,
                                   tp_w2_grad_doubled_in_one_block, tp_rope_half_keys)}


def inject(name: str) -> None:
    if name not in FAULTS:
        sys.exit(f"PROTOCOL_FAULT={name!r}: unknown fault; known: {', '.join(FAULTS)}")
    FAULTS[name]()
