"""The batch loader's copy to the device, and document masking in the model, in this process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.cuda.device import DEVICE
from trainer.data.finite_sources import TokenArraySource
from trainer.data.loader import BatchLoader
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.loss import IGNORE_INDEX
from trainer.models.llama3 import Transformer, get_flavor
from trainer.models.llama3.model import document_index

SEQ = 128


class TensorCalls(TorchFunctionMode):
    """Records the name and keyword arguments of every tensor function called inside it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__name__", str(func)), dict(kwargs)))
        return func(*args, **kwargs)


def loader(source, device: torch.device, **options) -> BatchLoader:
    return BatchLoader(source, seq_len=SEQ, global_batch_size=8, local_batch_size=4, dp_rank=0, dp_degree=1,
                       device=device, **options)


def busy(device: torch.device) -> None:
    """Queue some 0.1 to 0.3 s of GPU work (float32 4096^3 matmuls), so that copies queued behind
    it land after the host has drawn the next batches."""
    if device.type == "cuda":
        a = torch.randn(4096, 4096, device=device)
        for _ in range(50):
            a = torch.tanh(a @ a)


def test_batches_reach_the_device_unchanged_through_pinned_non_blocking_copies(figure):
    """On CUDA each batch is pinned and copied with non_blocking=True, once (inputs and labels are
    views of one tensor). 40 batches are drawn while the GPU is busy, so their copies are still
    queued when the host has moved on; every one must equal the CPU loader's batch."""
    device = torch.device(DEVICE)
    source = SyntheticMarkovSource(vocab_size=2048, seed=0)
    on_device, on_cpu = loader(source, device), loader(source, torch.device("cpu"))
    busy(device)
    with TensorCalls() as spy:
        first = on_device.next_batch()
    drawn = [first] + [on_device.next_batch() for _ in range(39)]
    expected = [on_cpu.next_batch() for _ in range(40)]
    for got, want in zip(drawn, expected):
        assert len(got) == len(want) == 2  # 8 rows in microbatches of 4
        for (inputs, labels), (cpu_inputs, cpu_labels) in zip(got, want):
            assert inputs.device.type == labels.device.type == DEVICE
            assert inputs.shape == labels.shape == (4, SEQ)
            assert inputs.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr()  # one copy
            assert torch.equal(inputs.cpu(), cpu_inputs) and torch.equal(labels.cpu(), cpu_labels)
    pins = [name for name, _ in spy.calls if name == "pin_memory"]
    copies = [kwargs for name, kwargs in spy.calls if name == "to"]
    figure(f"loader: one batch = {len(pins)} pin_memory, {len(copies)} copies {copies}; 40 batches equal the CPU's")
    if DEVICE == "cuda":
        assert len(pins) == 1 and len(copies) == 1 and copies[0].get("non_blocking") is True
    else:  # the CPU path uses the tensor as it is
        assert not pins and all(not kwargs.get("non_blocking") for kwargs in copies)


def test_document_labels_are_masked_on_the_device():
    """Document masking: the label after each EOS (the next document's first token) is ignored;
    the loader does it on the device's copy."""
    eos = 1
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 500, size=20 * (SEQ + 1)).astype(np.int32)
    tokens[rng.choice(len(tokens), size=200, replace=False)] = eos
    source = TokenArraySource(tokens, name="files:test", eos_id=eos)
    device = torch.device(DEVICE)
    on_device = loader(source, device, document_eos=eos)
    on_cpu = loader(TokenArraySource(tokens, name="files:test", eos_id=eos), torch.device("cpu"), document_eos=eos)
    for _ in range(3):
        for (inputs, labels), (cpu_inputs, cpu_labels) in zip(on_device.next_batch(), on_cpu.next_batch()):
            assert torch.equal(inputs.cpu(), cpu_inputs) and torch.equal(labels.cpu(), cpu_labels)
            assert (labels[inputs == eos] == IGNORE_INDEX).all()
            assert (labels[inputs != eos] != IGNORE_INDEX).all()


def test_document_masking_keeps_each_document_to_itself_on_the_device(figure):
    """A document's logits in a packed row equal its logits alone (RoPE sees relative positions
    only), in float32 and bfloat16, and the masked forward has gradients. On CUDA the mask runs
    SDPA with a boolean mask and K/V heads repeated (tests/unit/test_model.py checks float32 on
    the CPU). Tolerances, measured on the CPU with these weights: float32 1.4e-6 (bound 1e-4);
    bfloat16 1.6e-2, one bfloat16 ulp of logits in [2, 4) (bound 4e-2); without the mask the
    earlier document moves the logits by 0.22 (required: > 0.1)."""
    device = torch.device(DEVICE)
    args = get_flavor("debugmodel")
    args.max_seq_len = 64
    model = Transformer(args)
    model.init_weights(seed=0)  # on the CPU, so the same weights as there
    model.to(device)
    eos = 2
    g = torch.Generator().manual_seed(0)
    first = torch.randint(3, args.vocab_size, (1, 9), generator=g)
    second = torch.randint(3, args.vocab_size, (1, 12), generator=g)
    first[0, -1], second[0, -1] = eos, eos
    packed = torch.cat([first, second, torch.randint(3, args.vocab_size, (1, 43), generator=g)], dim=1)
    packed = torch.cat([packed, packed.roll(21, dims=1)])  # row 2: the documents in another order
    packed, first, second = packed.to(device), first.to(device), second.to(device)
    documents = document_index(packed, eos)
    assert documents[0, :21].tolist() == [0] * 9 + [1] * 12
    logits = model(packed, documents)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    errors, seen = {}, {}
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 4e-2)):
        for p in model.parameters():  # as FSDP's mixed precision: the weights in the compute dtype, RoPE's table not
            p.data = p.data.to(dtype)
        with torch.no_grad():
            masked = model(packed, documents).float()
            alone_first, alone_second = model(first).float(), model(second).float()
            plain = model(packed).float()
        assert masked.dtype == torch.float32 and model.output.weight.dtype == dtype
        errors[dtype] = max((masked[0, :9] - alone_first[0]).abs().max().item(),
                            (masked[0, 9:21] - alone_second[0]).abs().max().item(),
                            (masked[1, 21 + 9:21 + 21] - alone_second[0]).abs().max().item())
        seen[dtype] = (plain[0, 9:21] - alone_second[0]).abs().max().item()
        assert errors[dtype] <= tolerance and seen[dtype] > 0.1, (dtype, errors[dtype], seen[dtype])
    figure(f"document masking, a document packed vs alone: max |logit diff| float32 {errors[torch.float32]:.1e}, "
           f"bfloat16 {errors[torch.bfloat16]:.1e} (unmasked, the earlier document moves them by "
           f"{seen[torch.float32]:.2f})")


def test_flex_document_attention_equals_the_explicit_mask_on_the_device(figure):
    """training.document_masking_kernel = "flex" against "mask", forward and the gradients of q, k
    and v, on the device (the CPU has no flex backward: tests/unit/test_flex_document_attention.py
    compares the forward there). Bounds: float32 1e-5; bfloat16 3e-2, a few ulps of values near 1
    (the two kernels round differently)."""
    from trainer.models.llama3.flex_attention import flex_document_attention
    from trainer.models.llama3.model import document_causal_mask, grouped_query_attention

    device = torch.device(DEVICE)
    if device.type == "cpu":
        pytest.skip("torch's flex attention has no backward on a CPU (the unit test compares the forward)")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (2, 1024), generator=g)
    documents = document_index(tokens, 7).to(device)
    positions = torch.arange(1024, device=device)
    mask = document_causal_mask(documents, positions, positions)
    errors = {}
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v = (torch.randn(2, 1024, heads, 64, generator=g).to(device, dtype).requires_grad_()
                   for heads in (8, 4, 4))
        expected = grouped_query_attention(q, k, v, attn_mask=mask)
        expected_grads = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
        flex = flex_document_attention(q, k, v, documents)
        flex_grads = torch.autograd.grad(flex.float().square().sum(), (q, k, v))
        errors[dtype] = max([(flex - expected).abs().max().item()] +
                            [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(flex_grads, expected_grads)])
        assert errors[dtype] <= bound, (dtype, errors[dtype])
    figure(f"flex vs explicit-mask document attention: max diff (output; gradients relative) float32 "
           f"{errors[torch.float32]:.1e}, bfloat16 {errors[torch.bfloat16]:.1e}")


AC_MODES = {"AC full": ("full", "2"), "AC selective op": ("selective", "op")}  # (mode, selective option)


@pytest.mark.parametrize("mode", ["eager", "compile", *AC_MODES])
def test_a_model_trains_the_same_with_the_flex_kernel(mode, figure):
    """training.document_masking_kernel = "flex" inside the model, eager, compiled per block and
    under activation checkpointing, against the same model with the explicit mask: logits and
    every gradient in float32 within 1e-4 (relative to each tensor's largest value)."""
    from trainer.parallel import local_runtime

    device = torch.device(DEVICE)
    if device.type == "cpu":
        pytest.skip("torch's flex attention has no backward on a CPU (the unit test compares the forward)")
    args = get_flavor("debugmodel")
    args.max_seq_len = 512
    tokens = torch.randint(3, args.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0))
    tokens[:, ::37] = 2
    tokens = tokens.to(device)
    documents = document_index(tokens, 2)
    results = []
    for kernel in ("mask", "flex"):
        model = Transformer(args)
        model.init_weights(seed=0)
        model.to(device)
        ac_mode, ac_option = AC_MODES.get(mode, ("none", "2"))
        model.apply_runtime(local_runtime(model, ac_mode=ac_mode, ac_option=ac_option, document_kernel=kernel,
                                          compile_backend="inductor" if mode == "compile" else None))
        logits = model(tokens, documents)
        logits.float().logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (mask_logits, mask_grads), (flex_logits, flex_grads) = results
    worst = max([((flex_logits - mask_logits).abs().max() / mask_logits.abs().max()).item()] +
                [((flex_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in mask_grads.items()])
    figure(f"flex vs mask document attention in the model, {mode}: largest relative difference {worst:.1e}")
    assert worst <= 1e-4, (mode, worst)
