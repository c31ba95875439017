"""training.dtype = "bfloat16": the model is built, initialized and updated in bfloat16, with the
loss, the RoPE table and the gradient norm still in float32 or wider."""

from __future__ import annotations

import pytest
import torch

from trainer.config.job_config import Optimizer
from trainer.loss import cross_entropy_sum
from trainer.models.llama3 import Transformer, get_flavor
from trainer.optim import build_optimizer, clip_grad_norm
from trainer.parallel.fsdp import parameters_in


def tiny(dtype: torch.dtype) -> Transformer:
    args = get_flavor("tiny")
    args.max_seq_len = 16
    with torch.device("meta"), parameters_in(dtype):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, device="cpu")
    return model


def test_parameters_are_built_in_bfloat16_and_the_default_dtype_comes_back():
    model = tiny(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.freqs_cis.dtype == torch.complex64  # rotary embeddings stay in float32 precision
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(RuntimeError, match="inside"):
        with parameters_in(torch.bfloat16):
            raise RuntimeError("inside")
    assert torch.get_default_dtype() == torch.float32


def test_initial_weights_are_the_float32_ones_rounded():
    full, half = tiny(torch.float32), tiny(torch.bfloat16)
    for (name, p32), (_, p16) in zip(full.named_parameters(), half.named_parameters()):
        assert torch.equal(p16, p32.detach().to(torch.bfloat16)), name


def test_a_step_keeps_gradients_and_optimizer_state_in_bfloat16():
    model = tiny(torch.bfloat16)
    optimizer = build_optimizer(model.named_parameters(), Optimizer(lr=1e-2, weight_decay=0.0))  # as the trainer
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    assert logits.dtype == torch.bfloat16
    loss = cross_entropy_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()
    assert loss.dtype == torch.float32  # the loss is computed in float32 from the bfloat16 logits
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    norm = clip_grad_norm(model.parameters(), 1e-3)
    assert norm.dtype == torch.float64 and torch.isfinite(norm) and norm > 1e-3
    clipped = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()
    assert clipped.item() == pytest.approx(1e-3, rel=1e-2)  # clipped to max_norm, up to bfloat16 rounding
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    states = [optimizer.state[p] for p in model.parameters()]
    assert {s[key].dtype for s in states for key in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert all(moved)  # lr 1e-2 moves every weight by far more than its bfloat16 resolution
