"""Llama 3 model: published shapes and counts, FLOPs, attention, RoPE, deterministic init."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from trainer.models.llama3 import FLAVORS, Transformer, get_flavor
from trainer.models.llama3.args import LlamaModelArgs, RopeScaling, flops_per_token, num_params
from trainer.models.llama3.model import (
    CausalAttention,
    apply_rope,
    count_params_on_meta,
    rope_inverse_frequencies,
    rope_table,
)


@pytest.mark.parametrize("flavor, published", [
    ("1B", 1_235_814_400), ("3B", 3_212_749_824),  # Llama 3.2: output tied to the embedding
    ("8B", 8_030_261_248), ("70B", 70_553_706_496), ("405B", 405_853_388_800),
])
def test_published_parameter_counts_on_meta(flavor, published):
    assert count_params_on_meta(get_flavor(flavor)) == published


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_analytic_count_matches_meta_count(flavor):
    assert num_params(get_flavor(flavor)) == count_params_on_meta(get_flavor(flavor))


@pytest.mark.parametrize("flavor, hidden", [("8B", 14336), ("70B", 28672), ("405B", 53248), ("1B", 8192), ("3B", 8192)])
def test_ffn_hidden_dims(flavor, hidden):
    assert get_flavor(flavor).ffn_hidden_dim == hidden


def test_flops_per_token_by_hand():
    # tiny: dim 64, 4 layers, 4 heads (head_dim 16), 2 KV heads, vocab 256, ffn hidden 192.
    args = get_flavor("tiny")
    assert args.ffn_hidden_dim == 192
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # wq, wk, wv, wo
    ffn = 3 * 64 * 192
    matmul_weights = 4 * (attention + ffn) + 64 * 256  # blocks, output (no embedding, no norms)
    assert matmul_weights == 212_992
    seq_len = 32
    expected = 6 * matmul_weights + 12 * 4 * 4 * 16 * seq_len  # = 1,277,952 + 98,304
    assert flops_per_token(args, seq_len) == expected == 1_376_256


@pytest.mark.parametrize("flavor, seq_len", [("tiny", 32), ("tiny", 48), ("debugmodel", 64)])
def test_flops_per_token_matches_torch_flop_counter(flavor, seq_len):
    """torch's FlopCounterMode counts every matmul of a real forward + backward. With the math
    attention backend the score and value products are bmm calls it sees too (the fused CPU kernel
    is not counted), so the total must be the formula's exactly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    args = get_flavor(flavor)
    args.max_seq_len = seq_len
    model = Transformer(args)
    model.init_weights(0)
    batch = 2
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    counted = counter.get_total_flops()
    assert counted == flops_per_token(args, seq_len) * batch * seq_len
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert by_op["aten.bmm"] == 12 * args.n_layers * args.n_heads * args.head_dim * seq_len * batch * seq_len


def test_get_flavor_errors_and_copies():
    with pytest.raises(ValueError, match="choose one of tiny, debugmodel, 125M, 1B, 3B, 8B, 70B, 405B"):
        get_flavor("7B")
    args = get_flavor("tiny")
    args.max_seq_len = 5
    assert FLAVORS["tiny"].max_seq_len == 2048


def test_validate_catches_bad_shapes():
    with pytest.raises(ValueError, match="dim 65 is not divisible by n_heads 4"):
        Transformer(LlamaModelArgs(dim=65, n_layers=1, n_heads=4, vocab_size=8, multiple_of=8))
    with pytest.raises(ValueError, match="n_heads 4 is not divisible by n_kv_heads 3"):
        Transformer(LlamaModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=3, vocab_size=8, multiple_of=8))


def tiny_model(seed: int = 0, **changes) -> Transformer:
    args = get_flavor("tiny")
    args.max_seq_len = 64
    for key, value in changes.items():
        setattr(args, key, value)
    model = Transformer(args)
    model.init_weights(seed)
    return model


def test_forward_shape_and_causality():
    model = tiny_model()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 24, 256)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    other = model(changed)
    assert (logits[:, :10] - other[:, :10]).abs().max().item() == 0.0
    assert (logits[:, 10:] - other[:, 10:]).abs().max().item() > 1e-3


def test_grouped_query_attention_matches_naive_reference():
    model = tiny_model().double()
    attention = model.layers["0"].attention
    x = torch.randn(2, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = attention(x, model.freqs_cis)
    freqs = model.freqs_cis[:12]

    q = apply_rope(attention.wq(x).view(2, 12, 4, 16), freqs)
    k = apply_rope(attention.wk(x).view(2, 12, 2, 16), freqs)
    v = attention.wv(x).view(2, 12, 2, 16)
    heads = []
    for h in range(4):
        kv = h // 2  # query heads 0,1 share KV head 0; 2,3 share KV head 1
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(16)
        scores = scores.masked_fill(torch.ones(12, 12).triu(1).bool(), float("-inf"))
        heads.append(F.softmax(scores, dim=-1) @ v[:, :, kv])
    expected = attention.wo(torch.stack(heads, dim=2).reshape(2, 12, 64))
    assert (got - expected).abs().max().item() < 1e-10


class RepeatedKVAttention(CausalAttention):
    """The attention core before enable_gqa: every query head gets its own copy of its K/V head."""

    def __call__(self, q, k, v, documents=None):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        copies = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def saved_bytes(block, x, rope) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct activation storages autograd keeps for backward, output) of one
    block's forward; the weights and the RoPE table, kept anyway, are not counted."""
    kept_anyway = {t.untyped_storage().data_ptr() for t in [*block.parameters(), rope]}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in kept_anyway:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, rope)
    return sum(storages.values()), out


def gqa_saved_bytes(dim: int, heads: int, kv_heads: int, batch: int = 2, seq: int = 64):
    """(saved bytes with repeated K/V, saved bytes now, K/V bytes saved once, outputs and input grads of both)."""
    args = LlamaModelArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, vocab_size=8, multiple_of=32,
                          max_seq_len=seq)
    model = Transformer(args)
    model.init_weights(0)
    block = model.layers["0"]
    results = []
    for core in (RepeatedKVAttention(), CausalAttention()):
        block.apply_runtime(replace(block.runtime, attention_core=core))
        x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(2), requires_grad=True)
        saved, out = saved_bytes(block, x, model.freqs_cis)
        out.backward(torch.ones_like(out))
        results.append((saved, out.detach(), x.grad))
    kv_once = 2 * batch * seq * kv_heads * args.head_dim * 4  # K and V, float32
    return results[0][0], results[1][0], kv_once, results


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (32, 8)])  # the tiny flavor's ratio; Llama 3 8B/70B's
def test_gqa_keeps_keys_and_values_once_for_backward(heads, kv_heads):
    before, after, kv_once, ((_, old_out, old_grad), (_, out, grad)) = gqa_saved_bytes(128, heads, kv_heads)
    # The repeated K/V (heads / kv_heads copies) are no longer kept; K and V are kept once.
    assert before - after == kv_once * (heads // kv_heads - 1)
    assert torch.equal(out, old_out)
    torch.testing.assert_close(grad, old_grad, rtol=0, atol=1e-6)


def test_rope_scaling_keeps_high_and_divides_low_frequencies():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain = rope_inverse_frequencies(128, 500000.0, None)
    scaled = rope_inverse_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any()
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8.0)
    middle = ~(high | low)
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0)).all()


def test_rope_preserves_norm_and_depends_on_relative_position():
    args = LlamaModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=8, multiple_of=8, max_seq_len=64)
    table = rope_table(args).unsqueeze(0)  # (1, 64, 8)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def at(x, position):
        return apply_rope(x, table[:, position:position + 1])

    assert torch.allclose(at(q, 7).norm(), q.norm(), atol=1e-5)
    dot_a = (at(q, 10) * at(k, 3)).sum()
    dot_b = (at(q, 40) * at(k, 33)).sum()
    assert dot_a.item() == pytest.approx(dot_b.item(), abs=1e-4)
    assert abs((at(q, 10) * at(k, 4)).sum().item() - dot_a.item()) > 1e-4


def test_init_is_deterministic_per_seed():
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_meta_init_equals_direct_init():
    direct = tiny_model(3)
    args = get_flavor("tiny")
    args.max_seq_len = 64
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    meta.init_weights(3, device="cpu")
    for (name, p), q in zip(direct.named_parameters(), meta.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(direct.freqs_cis, meta.freqs_cis)


def test_init_standard_deviations():
    args = LlamaModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=512, multiple_of=64)
    model = Transformer(args)
    model.init_weights(0)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    block = model.layers["0"]
    # A normal truncated at +-3 std keeps sqrt(1 - 6 phi(3) / (2 Phi(3) - 1)) = 0.9866 of its std.
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02 * 0.9866, rel=0.03)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / 4 * 0.9866, rel=0.03)
    assert model.output.weight.std().item() == pytest.approx(256 ** -0.5 * 0.9866, rel=0.03)
    assert block.attention.wq.weight.abs().max().item() <= 3 * 0.02
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


def test_tiny_model_overfits_one_batch():
    model = tiny_model(0)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0]


if __name__ == "__main__":
    # The saved-activation table of docs/performance_measurements.md.
    print("| dim | heads | kv heads | saved with repeated K/V | saved now | change | K and V kept once |")
    print("|---|---|---|---|---|---|---|")
    for dim, heads, kv_heads in ((64, 4, 2), (512, 32, 8), (512, 64, 8)):
        before, after, kv_once, _ = gqa_saved_bytes(dim, heads, kv_heads)
        print(f"| {dim} | {heads} | {kv_heads} | {before / 2**10:.0f} KiB | {after / 2**10:.0f} KiB "
              f"| {100 * (after - before) / before:.1f}% | {kv_once / 2**10:.0f} KiB |")


def test_document_masking_makes_each_document_its_own_sequence():
    """Attention within documents: a document's logits in a packed row equal its logits alone
    (RoPE sees only relative positions), whatever precedes it."""
    from trainer.models.llama3.model import document_index

    torch.manual_seed(0)
    args = get_flavor("debugmodel")
    model = Transformer(args)
    model.init_weights(seed=0)
    eos = 2
    first, second = torch.randint(3, args.vocab_size, (1, 9)), torch.randint(3, args.vocab_size, (1, 12))
    first[0, -1], second[0, -1] = eos, eos
    packed = torch.cat([first, second, torch.randint(3, args.vocab_size, (1, 11))], dim=1)
    documents = document_index(packed, eos)
    assert documents[0].tolist() == [0] * 9 + [1] * 12 + [2] * 11
    with torch.no_grad():
        masked = model(packed, documents)
        torch.testing.assert_close(masked[:, 9:21], model(second), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(masked[:, :9], model(first), rtol=1e-5, atol=1e-5)
        plain = model(packed)
    assert (plain[:, 9:21] - model(second)).abs().max() > 1e-2  # without masking, the first document is seen


def test_tied_embeddings_are_one_parameter_used_twice():
    args = get_flavor("tiny")
    args.tie_embeddings = True
    model = Transformer(args)
    model.init_weights(seed=0)
    names = [name for name, _ in model.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    # Drawn as an output layer (std dim^-0.5, truncated at 3 std), not as a unit-std embedding.
    weight = model.tok_embeddings.weight
    assert abs(weight.std().item() - 64 ** -0.5) < 0.01 and weight.abs().max() <= 3 * 64 ** -0.5
    tokens = torch.randint(0, 256, (2, 8))
    logits = model(tokens)
    hidden = model.norm(model.layers["3"](model.layers["2"](model.layers["1"](model.layers["0"](
        weight[tokens], model.freqs_cis), model.freqs_cis), model.freqs_cis), model.freqs_cis))
    torch.testing.assert_close(logits, hidden @ weight.T, rtol=0, atol=0)
    # The gradient is the sum of both uses: a model whose output is a separate copy of the same
    # values gets the two halves, which add up to the tied gradient.
    logits.square().mean().backward()
    untied = Transformer(get_flavor("tiny"))
    untied.load_state_dict({**model.state_dict(), "output.weight": weight.detach().clone()})
    untied(tokens).square().mean().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(weight.grad, both, rtol=1e-5, atol=1e-7)


def test_a_tied_model_stays_tied_when_materialized_from_the_meta_device():
    args = get_flavor("tiny")
    args.tie_embeddings = True
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())


def test_an_untied_checkpoint_is_refused_by_a_tied_model(tmp_path):
    """Its separate output layer would otherwise be dropped without a word."""
    from trainer.checkpoint.manager import CheckpointError, check_model_shapes, save_seed_checkpoint

    untied = Transformer(get_flavor("tiny"))
    untied.init_weights(seed=0)
    path = save_seed_checkpoint(untied, tmp_path, overwrite=False)
    check_model_shapes(path, untied, "tiny")
    args = get_flavor("tiny")
    args.tie_embeddings = True
    with pytest.raises(CheckpointError, match="has a separate output.weight .* ties it to tok_embeddings.weight"):
        check_model_shapes(path, Transformer(args), "hf")
