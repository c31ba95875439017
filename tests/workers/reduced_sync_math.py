"""Reduced-synchronization TP against its definition, computed without any parallelism.

`torchrun --nproc_per_node 2 -m tests.workers.reduced_sync_math OUT.json`: for each variant
(full, per_block, grouped by 2 and by 4) every rank builds the same tiny Llama, splits it over
the 2 TP ranks as the trainer does, runs forward and backward on one batch, and compares the
logits and gradients with `simulate`, which computes each rank's partial sums from slices of the
whole weights in one process (docs/parallelisms.md, "Reduced synchronization"). Rank 0 writes
the largest differences, and how far each variant is from exact TP, to OUT.json.

The output projections (wo, w2) are scaled up so that a rank's missing partial sums change the
result by far more than rounding: the comparison can tell the variants apart.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from trainer.models.llama3.args import FLAVORS
from trainer.models.llama3.model import Transformer, apply_rope
from trainer.parallel import model_runtime
from trainer.parallel.tensor import apply_tp
from trainer.launch.process_exit import exit_without_teardown

TP = 2
VARIANTS = {"full": ("full", 0), "per_block": ("per_block", 0), "grouped 2": ("grouped", 2), "grouped 4": ("grouped", 4)}


def build(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                param.mul_(20.0)
            elif "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    return model


def rank_attention(block, x: torch.Tensor, rope: torch.Tensor, r: int) -> torch.Tensor:
    """Rank r's heads of the block's attention, through its columns of wo: its partial sum."""
    att = block.attention
    batch, seq, _ = x.shape
    q = F.linear(x, att.wq.weight.chunk(TP, 0)[r]).view(batch, seq, -1, att.head_dim)
    k = F.linear(x, att.wk.weight.chunk(TP, 0)[r]).view(batch, seq, -1, att.head_dim)
    v = F.linear(x, att.wv.weight.chunk(TP, 0)[r]).view(batch, seq, -1, att.head_dim)
    freqs = rope[:seq]
    out = F.scaled_dot_product_attention(apply_rope(q, freqs).transpose(1, 2), apply_rope(k, freqs).transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), att.wo.weight.chunk(TP, 1)[r])


def rank_ffn(block, x: torch.Tensor, r: int) -> torch.Tensor:
    ffn = block.feed_forward
    hidden = F.silu(F.linear(x, ffn.w1.weight.chunk(TP, 0)[r])) * F.linear(x, ffn.w3.weight.chunk(TP, 0)[r])
    return F.linear(hidden, ffn.w2.weight.chunk(TP, 1)[r])


def simulate(model: Transformer, tokens: torch.Tensor, group: int) -> torch.Tensor:
    """Logits of the reduced-sync model with `group` blocks per synchronization, in one process."""
    blocks = list(model.layers.values())
    h = model.tok_embeddings(tokens)
    for start in range(0, len(blocks), group):
        partial = [torch.zeros_like(h) for _ in range(TP)]
        for block in blocks[start:start + group]:
            for r in range(TP):
                own = h + partial[r]
                a = rank_attention(block, block.attention_norm(own), model.freqs_cis, r)
                f = rank_ffn(block, block.ffn_norm(own + a), r)
                partial[r] = partial[r] + a + f
        h = h + sum(partial)
    return model.output(model.norm(h))


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(variant: str, mesh, tokens: torch.Tensor) -> dict:
    sync, group = VARIANTS[variant]
    reference = build()
    expected = simulate(reference, tokens, 1 if sync == "per_block" else group) if sync != "full" else reference(tokens)
    loss_of(expected, tokens).backward()
    model = build()
    parts = apply_tp(model, mesh, loss_parallel=False, sync=sync, sync_group=group, n_layers=model.args.n_layers)
    model.apply_runtime(model_runtime(model, "mask", parts, None, dict.fromkeys(model.layers), None, None))
    logits = model(tokens)
    loss_of(logits, tokens).backward()
    grads = {name: (local(p.grad), dict(reference.named_parameters())[name].grad) for name, p in model.named_parameters()}
    exact = build()(tokens)
    return {
        "logits": (logits - expected).abs().max().item(),
        "gradients": max(((g - e).abs().max() / e.abs().max()).item() for g, e in grads.values()),
        "from_exact_tp": (expected - exact).abs().max().item(),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {variant: compare(variant, mesh, tokens) for variant in VARIANTS}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


if __name__ == "__main__":
    main(sys.argv[1])
