"""Llama 3 shapes: the model arguments, the published flavors, parameter and FLOP counts.

No torch import here: the config validator checks flavor names in a light process.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling of RoPE for long contexts."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class LlamaModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    multiple_of: int
    n_kv_heads: Optional[int] = None
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScaling] = None
    max_seq_len: int = 2048  # rows of the RoPE table; the trainer sets it to training.seq_len
    # The output projection is the token embedding matrix (Llama 3.2 1B and 3B): one parameter,
    # named tok_embeddings.weight, serves both.
    tie_embeddings: bool = False
    # The FFN width when a checkpoint gives it outright (config.json's intermediate_size) rather
    # than through multiple_of and ffn_dim_multiplier.
    ffn_dim: Optional[int] = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Llama's SwiGLU width: 2/3 of 4*dim (same parameters as a 4*dim GELU MLP), scaled, rounded up."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len", "ffn_hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model: {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model: n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model: head_dim {self.head_dim} must be even for rotary embeddings")


LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

FLAVORS: dict[str, LlamaModelArgs] = {
    # Test flavor: 4 layers so pipeline tests can split it; runs in milliseconds on a CPU.
    "tiny": LlamaModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32),
    # Trains on a CPU in minutes (~5M parameters).
    "debugmodel": LlamaModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=2048, multiple_of=256),
    # GPT-2-small scale (125M parameters, 75M of them in the blocks), not a published Llama: large
    # enough that model state dominates a CPU process's memory, small enough to train on one.
    "125M": LlamaModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32768, multiple_of=256),
    # Llama 3.2 1B and 3B: the output layer is the token embedding (1.24e9 and 3.21e9 parameters).
    "1B": LlamaModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                         ffn_dim_multiplier=1.5, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True),
    "3B": LlamaModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                         ffn_dim_multiplier=1.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True),
    "8B": LlamaModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                         ffn_dim_multiplier=1.3, rope_scaling=LLAMA31_SCALING),
    "70B": LlamaModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                          ffn_dim_multiplier=1.3, rope_scaling=LLAMA31_SCALING),
    "405B": LlamaModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                           multiple_of=4096, ffn_dim_multiplier=1.2, rope_scaling=LLAMA31_SCALING),
}


def get_flavor(name: str) -> LlamaModelArgs:
    if name not in FLAVORS:
        raise ValueError(f"unknown Llama 3 flavor {name!r}; choose one of {', '.join(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name])


def num_params(args: LlamaModelArgs, include_embedding: bool = True) -> int:
    """Analytic parameter count (the model's meta-device count must agree). A tied embedding is
    counted once, as the output layer's weight."""
    total = matmul_params(args) + (2 * args.n_layers + 1) * args.dim  # + RMSNorm weights
    separate_embedding = include_embedding and not args.tie_embeddings
    return total + (args.dim * args.vocab_size if separate_embedding else 0)


def matmul_params(args: LlamaModelArgs) -> int:
    """Weights that take part in a matrix multiply: attention and FFN projections, and the output
    layer (tied or not). Not the token embedding lookup nor the RMSNorm weights (elementwise)."""
    d, hd = args.dim, args.head_dim
    attention = d * args.n_heads * hd * 2 + d * args.kv_heads * hd * 2  # wq, wo; wk, wv
    ffn = 3 * d * args.ffn_hidden_dim
    return args.n_layers * (attention + ffn) + d * args.vocab_size


def flops_per_token(args: LlamaModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N + 12 * n_layers * n_heads * head_dim * seq_len.

    N is `matmul_params`: every weight a token's activations are multiplied by, once each.
    6 = 2 (multiply-add) x 3 (forward, input grads, weight grads). The second term is the
    attention score and value matmuls (2 x 2 x seq_len x head_dim per head and token, times 3),
    counted over the full seq_len x seq_len matrix as MFU is conventionally reported (PaLM,
    appendix B); a causal kernel that skips masked blocks does about half of that work.
    Elementwise work (norms, RoPE, softmax, SwiGLU gating) is left out. tests/unit/test_model.py
    checks the formula against torch's FLOP counter on a real forward and backward.
    """
    return 6.0 * matmul_params(args) + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
