"""One process computing in bfloat16 over float32 weights runs without FSDP: the model casts its
weights itself (ModelRuntime.compute_dtype). Its losses and float32 gradients must be exactly
those of FSDP's parameter-dtype policy over a one-rank mesh, which it replaces."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from trainer.loss import cross_entropy_sum
from trainer.models.llama3 import Transformer, get_flavor
from trainer.parallel.fsdp import apply_fsdp


def two_microbatches(model: Transformer, tokens: torch.Tensor) -> list[float]:
    """Gradients accumulated over two microbatches (the loss of invariant 2); their losses."""
    losses = []
    for rows in tokens.split(2):
        loss = cross_entropy_sum(model(rows[:, :-1]), rows[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        losses.append(loss.item())
    return losses


def full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def fsdp_and_cast(args, mesh) -> tuple[Transformer, Transformer, torch.Tensor]:
    """The same initial weights under FSDP over one rank computing in bfloat16 and under the
    model's own bfloat16 cast, and a batch of 4 sequences for them."""
    base = Transformer(args)
    base.init_weights(seed=0)
    fsdp, cast = copy.deepcopy(base), copy.deepcopy(base)
    apply_fsdp(fsdp, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=True)
    cast.apply_runtime(replace(cast.runtime, compute_dtype=torch.bfloat16))
    return fsdp, cast, torch.randint(0, args.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_cast_gives_fsdp_numbers_exactly(one_rank_mesh, tied):
    fsdp, cast, tokens = fsdp_and_cast(replace(get_flavor("tiny"), max_seq_len=16, tie_embeddings=tied), one_rank_mesh)

    assert two_microbatches(cast, tokens) == two_microbatches(fsdp, tokens)
    cast_grads = dict((name, p.grad) for name, p in cast.named_parameters())
    for name, p in fsdp.named_parameters():
        assert cast_grads[name].dtype == torch.float32, name
        assert torch.equal(cast_grads[name], full(p.grad)), name
    # The stored weights stay float32; only what the layers compute with is bfloat16.
    assert {p.dtype for p in cast.parameters()} == {torch.float32}
    assert cast(tokens[:, :-1]).dtype == torch.bfloat16


def test_without_a_compute_dtype_nothing_is_cast():
    args = get_flavor("tiny")
    args.max_seq_len = 16
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    before = model(tokens)
    model.apply_runtime(replace(model.runtime, compute_dtype=torch.bfloat16))
    model.apply_runtime(replace(model.runtime, compute_dtype=None))
    assert before.dtype == torch.float32 and torch.equal(model(tokens), before)



def forward_backward_peak(model: Transformer, tokens: torch.Tensor) -> int:
    """The peak bytes of forward and backward over two microbatches, as the estimator's tracker
    counts them on real tensors (trainer/estimate/step_memory.py)."""
    from trainer.estimate.step_memory import StepMemory

    memory = StepMemory()
    memory.track_external(model)
    with memory:
        two_microbatches(model, tokens)
    return memory.peak().total


def cast_weights_kept_for_backward(model: Transformer, tokens: torch.Tensor) -> list[str]:
    """The parameters whose bfloat16 cast one forward leaves saved for backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(tokens[:, :-1])
    casts = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters() if p.dim() == 2}
    return sorted({name for t in saved if t.dtype == torch.bfloat16 and t.dim() == 2 for name, cast in casts.items()
                   if any(t.shape == c.shape and torch.equal(t, c) for c in (cast, cast.t()))})


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_cast_holds_no_copy_of_the_weights_between_forward_and_backward(one_rank_mesh, tied):
    """A layer computing with a bfloat16 cast of its float32 weight keeps the float32 weight for
    backward, not the cast (F.linear would keep the cast: a second copy of every weight until
    backward, 5.5 MB of this model's 32.8 MB peak, measured), and its peak is at most FSDP's over
    one rank, which frees each block's cast after its forward (27.3 MB against FSDP's 35.0 MB)."""
    args = replace(get_flavor("tiny"), dim=256, n_layers=4, max_seq_len=16, tie_embeddings=tied)
    fsdp, cast, tokens = fsdp_and_cast(args, one_rank_mesh)
    assert cast_weights_kept_for_backward(cast, tokens) == []
    assert forward_backward_peak(cast, tokens) <= forward_backward_peak(fsdp, tokens)
