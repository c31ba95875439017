"""Document masking through flex attention (training.document_masking_kernel = "flex"): the same
attention as the explicit mask. torch's flex attention has no backward on a CPU, so here the
forward is compared (in eager, its reference implementation, and compiled, the kernel a GPU
runs); tests/cuda/test_in_process.py compares forward and gradients on the device."""

from __future__ import annotations

import pytest
import torch

from trainer.config.errors import ConfigError
from trainer.config.manager import load_config
from trainer.models.llama3 import Transformer, get_flavor
from trainer.models.llama3.flex_attention import document_block_mask, flex_document_attention
from trainer.models.llama3.model import CausalAttention, document_causal_mask, document_index, grouped_query_attention
from trainer.preflight.checks import check_device_options

EOS = 7


def packed_documents(batch: int, length: int, seed: int) -> torch.Tensor:
    """Document indices of rows of random tokens in which EOS ends many short documents."""
    tokens = torch.randint(0, 40, (batch, length), generator=torch.Generator().manual_seed(seed))
    return document_index(tokens, EOS)


@pytest.mark.parametrize("length", [200, 256])  # one not a multiple of flex attention's 128-token blocks
def test_flex_attention_equals_the_explicit_mask(length):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, length, 4, 16, generator=g)
    k, v = torch.randn(2, length, 2, 16, generator=g), torch.randn(2, length, 2, 16, generator=g)
    documents = packed_documents(2, length, seed=length)
    assert documents[:, -1].min() >= 5  # several documents in every row
    positions = torch.arange(length)
    expected = grouped_query_attention(q, k, v, attn_mask=document_causal_mask(documents, positions, positions))
    with torch.no_grad():
        eager = flex_document_attention(q, k, v, documents)  # the compiled kernel, outside any graph
    assert (eager - expected).abs().max().item() < 1e-6


def test_the_block_mask_skips_blocks_no_query_sees():
    """Two documents of 256 tokens each in a 512-token row: the second document's queries see no
    key block of the first, so 3 of the 4 x 4 blocks' lower triangle (10 blocks) are empty."""
    documents = torch.cat([torch.zeros(256, dtype=torch.int64), torch.ones(256, dtype=torch.int64)])[None]
    mask = document_block_mask(documents)
    visible = mask.to_dense()[0, 0]  # (query blocks, key blocks): 1 where a block is computed
    assert visible.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_a_model_with_the_flex_kernel_gives_the_masked_logits():
    args = get_flavor("tiny")
    args.max_seq_len = 128
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(2))
    tokens[:, ::9] = EOS
    documents = document_index(tokens, EOS)
    with torch.no_grad():
        masked = model(tokens, documents)
        model.apply_runtime(model.runtime.with_blocks(attention_core=CausalAttention("flex")))
        flex = model(tokens, documents)
    assert (flex - masked).abs().max().item() < 1e-5


def test_the_flex_kernel_is_refused_on_the_cpu_before_training():
    config = load_config(["--training.dataset", "shards", "--training.document_masking",
                          "--training.document_masking_kernel", "flex"])
    with pytest.raises(ConfigError, match="training.document_masking_kernel: 'flex'.*use 'mask'"):
        check_device_options(config, "cpu")
    check_device_options(config, "cuda")


def test_the_flex_kernel_is_refused_with_tensor_parallelism():
    from trainer.preflight.checks import plan_layout

    flex = ["--training.dataset", "shards", "--training.document_masking", "--training.document_masking_kernel", "flex"]
    with pytest.raises(ConfigError, match="training.document_masking_kernel: 'flex' is not available with tensor "
                                          "parallelism"):
        plan_layout(load_config([*flex, "--parallelism.tensor_parallel_degree", "2"]), 2)
    assert plan_layout(load_config(flex), 2).dims.tp == 1


def test_the_flex_kernel_is_refused_with_context_parallelism():
    """Under CP the ring attention masks documents itself: the key would be silently ignored."""
    from trainer.preflight.checks import plan_layout

    flex = ["--training.dataset", "shards", "--training.document_masking", "--training.document_masking_kernel", "flex"]
    with pytest.raises(ConfigError, match="training.document_masking_kernel: 'flex' does not apply under context "
                                          r"parallelism \(context_parallel_degree=2\).*use 'mask'"):
        plan_layout(load_config([*flex, "--parallelism.context_parallel_degree", "2"]), 2)
