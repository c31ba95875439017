"""The Llama 3 decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Built on the meta device and materialized by `init_weights`, which draws every parameter from a
generator seeded by (seed, parameter name) as the full tensor and keeps the local shard: the same
seed gives the same global weights whatever the sharding.

How each block computes under the parallelisms (its attention core, recompute, compile, sync,
norm-weight handling, compute dtype) is one frozen description, `runtime.ModelRuntime`, that
`parallelize` builds and `Transformer.apply_runtime` installs; the forward reads it. The
parallelisms never change a parameter's name, so checkpoints and Hugging Face interop are the
same in every layout.

A compute dtype (ModelRuntime.compute_dtype) makes every layer compute with its parameters cast to
a lower dtype (bfloat16 over float32 weights) in one process, where FSDP would shard nothing: the
numbers are those FSDP's parameter-dtype policy gives, without its per-block copies and hooks.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.llama3.args import LlamaModelArgs, RopeScaling
from trainer.models.llama3.initialization import copy_global_into, parameter_seed, truncated_normal_
from trainer.models.llama3.runtime import BlockRuntime, ModelRuntime, default_runtime


class CastsWeights:
    """A layer that can compute with its parameters cast to `compute_dtype` (None: as stored).

    The cast happens where the weight is used, so autograd returns its gradient in the stored
    dtype: a bfloat16 gradient cast to float32, which is what FSDP's gradient reduction gives in
    one process. Compiled blocks fuse the casts into their graph."""

    compute_dtype: torch.dtype | None = None

    def cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.compute_dtype is None else weight.to(self.compute_dtype)


class RecastLinear(torch.autograd.Function):
    """F.linear(x, weight.to(dtype)) that keeps the stored weight for backward (`stored`: a float32
    parameter) and casts it again there, where F.linear would keep the cast copy alive from forward
    to backward: a second copy of every weight in the compute dtype, which FSDP frees after each
    block's forward. The backward is linear's own (the same matmuls in the same order: bitwise
    equal). `weight`: what the layer uses (`stored`, or its one cast a tied weight shares)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, stored)
        ctx.dtype, ctx.weight_dtype = dtype, weight.dtype
        return F.linear(x, weight.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, stored = ctx.saved_tensors
        grad_x = grad.matmul(stored.to(ctx.dtype)) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # mm's own backward: grad^T x over the flattened tokens
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])).to(ctx.weight_dtype)
        return grad_x, grad_weight, None, None


class Linear(CastsWeights, nn.Linear):
    # Reduced-synchronization tensor parallelism (BlockRuntime.local_shard_weights): the weight is
    # a DTensor shard applied to plain tensors with its local shard: a column-split weight gives
    # this rank's output features, a row-split one its partial sums of every output feature. No
    # collective; the weight's gradient stays a shard.
    local_shard: bool = False

    def forward(self, x: torch.Tensor, cast_weight: torch.Tensor | None = None) -> torch.Tensor:
        """`cast_weight`: this layer's weight already cast (a tied weight is cast once)."""
        if self.compute_dtype is not None and self.bias is None and not self.local_shard:
            return RecastLinear.apply(x, self.weight if cast_weight is None else cast_weight, self.weight,
                                      self.compute_dtype)
        bias = None if self.bias is None else self.cast(self.bias)
        if cast_weight is None:
            cast_weight = self.cast(self.weight.to_local() if self.local_shard else self.weight)
        return F.linear(x, cast_weight, bias)


class Embedding(CastsWeights, nn.Embedding):
    def forward(self, tokens: torch.Tensor, cast_weight: torch.Tensor | None = None) -> torch.Tensor:
        # The whole table is cast before the lookup, as FSDP casts it: its gradient is then
        # accumulated in the compute dtype, as under FSDP, and the numbers stay the same.
        weight = self.cast(self.weight) if cast_weight is None else cast_weight
        return F.embedding(tokens, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


class RMSNorm(CastsWeights, nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # What the weight passes through before use (runtime.NormWeights: tensor parallelism's sum
        # of its gradient over the TP ranks in the reduce dtype); None: nothing.
        self.weight_hook = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32: the mean of squares loses precision in bfloat16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.weight_hook is None else self.weight_hook(self.weight)
        return normed.type_as(x) * self.cast(weight)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """theta^(-2i/head_dim), optionally with Llama 3.1 scaling of the low frequencies.

    Wavelengths shorter than original_len / high_freq_factor are kept, longer than
    original_len / low_freq_factor are divided by `factor`, and those in between are blended.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq.float()
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    scaled = torch.where(wavelen < high_wavelen, inv_freq, scaled)
    return scaled.float()


def rope_table(args: LlamaModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim/2) unit complex numbers e^{i * position * frequency}."""
    inv_freq = rope_inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (0,1), (2,3), ... of each head. x: (B, T, H, D); freqs: (T, D/2) or (B, T, D/2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs.unsqueeze(-2)).flatten(-2)
    return rotated.type_as(x)


class CausalAttention:
    """The attention core of a rank that holds whole sequences: positions 0..T-1, causal mask.

    Context parallelism gives the blocks a core whose rank holds a subset of the positions and
    gathers the keys and values of the others instead (BlockRuntime.attention_core,
    trainer/parallel/context_parallel.py); both keep this interface.

    `document_kernel` (training.document_masking_kernel) is how document masking attends: "mask",
    SDPA with an explicit mask; "flex", block-sparse flex attention (flex_attention.py; CUDA only).
    """

    def __init__(self, document_kernel: str = "mask"):
        self.document_kernel = document_kernel

    def describe(self) -> str:
        return f"causal SDPA over whole sequences, documents by {self.document_kernel}"

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Sequence positions of the local query rows (they index the RoPE table)."""
        return torch.arange(local_len, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, T, H, D), k and v (B, T, H_kv, D) -> (B, T, H, D). documents (B, T): each
        position's document index; given, a position sees only earlier ones of its document."""
        if documents is None:
            return grouped_query_attention(q, k, v, is_causal=True)
        if self.document_kernel == "flex":
            from trainer.models.llama3.flex_attention import flex_document_attention

            return flex_document_attention(q, k, v, documents)
        positions = torch.arange(q.shape[1], device=q.device)
        return grouped_query_attention(q, k, v, attn_mask=document_causal_mask(documents, positions, positions))


def document_causal_mask(documents: torch.Tensor, query_positions: torch.Tensor,
                         key_positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T_q, T_k) boolean: the key is at or before the query and in the same document."""
    causal = query_positions[:, None] >= key_positions[None, :]
    same = documents[:, query_positions, None] == documents[:, None, key_positions]
    return (causal & same).unsqueeze(1)


def document_index(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) index of the document each position belongs to: a document ends with its EOS."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, S, H_kv, D) -> (B, T, H, D); each K/V head serves H / H_kv
    consecutive query heads (under TP each rank holds a slice of both, in the same ratio).

    The kernel shares the K/V heads itself (enable_gqa), so autograd keeps K and V once rather
    than H / H_kv copies of them. The exception: on CUDA a mask with enable_gqa falls back to the
    math kernel, which builds the whole score matrix; there the copies are cheaper.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    grouped = q.shape[1] != k.shape[1]
    if grouped and attn_mask is not None and q.device.type == "cuda":
        k, v, grouped = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=grouped)
    return out.transpose(1, 2)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x (B, H_kv, S, D) -> (B, heads, S, D): head j of the result is K/V head j // (heads / H_kv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


class Attention(nn.Module):
    def __init__(self, args: LlamaModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = CausalAttention()  # the block's runtime sets it (BlockRuntime.attention_core)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); rope is the whole RoPE table, indexed by the core's
        positions; documents (B, T over the whole sequence), when given, masks attention to
        each position's own document."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        freqs = rope[self.core.positions(seq, rope.device)]
        out = self.core(apply_rope(q, freqs), apply_rope(k, freqs), v, documents)
        return self.wo(out.reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.runtime = BlockRuntime(attention_core=self.attention.core)
        self._compiled_compute = None  # `compute` compiled, when the runtime compiles it alone

    def apply_runtime(self, runtime: BlockRuntime) -> None:
        """Compute as `runtime` says from now on (see trainer/models/llama3/runtime.py)."""
        if self.runtime.compile is not None:
            raise RuntimeError("a compiled block's runtime cannot change")
        self.runtime = runtime
        self.attention.core = runtime.attention_core
        hook = runtime.norm_weights.hook if runtime.norm_weights is not None else None
        self.attention_norm.weight_hook = self.ffn_norm.weight_hook = hook
        for module in self.modules():
            if isinstance(module, Linear):
                module.local_shard = runtime.local_shard_weights
        if runtime.compile is not None and runtime.compile.scope == "compute":
            self._compiled_compute = torch.compile(self.compute, backend=runtime.compile.backend)
        elif runtime.compile is not None:
            self.compile(backend=runtime.compile.backend)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None,
                branches: bool = False):
        """The block's output; with `branches`, (output, attention branch, feed-forward branch):
        what the attention and the FFN add to the residual stream, detached, for
        metrics.fingerprints (None under reduced sync, where each rank holds a partial sum)."""
        compute = self._compiled_compute or self.compute
        recompute = self.runtime.recompute
        if recompute is not None:
            return recompute.run(compute, x, rope, documents, branches)
        return compute(x, rope, documents, branches)

    def compute(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None,
                branches: bool = False):
        # The branches are returned rather than handed to a probe here: a compiled block then
        # traces one more graph for the steps that ask (no graph break, and the graph of the
        # other steps is unchanged), and the recomputation of activation checkpointing, whose
        # outputs are discarded, cannot count them a second time.
        sync = self.runtime.sync
        if sync is not None:
            out = sync(self, x, rope, documents)
            return (out, None, None) if branches else out
        attention = self.attention(self.attention_norm(x), rope, documents)
        h = x + attention
        ffn = self.feed_forward(self.ffn_norm(h))
        out = h + ffn
        return (out, attention.detach(), ffn.detach()) if branches else out


class Transformer(nn.Module):
    """Token embedding, blocks, final norm, output projection (tied to the embedding when
    args.tie_embeddings: then one parameter, tok_embeddings.weight, serves both).

    `layers` is a ModuleDict keyed by the original layer index, so a pipeline stage can delete
    the blocks it does not own and keep parameter names stable; tok_embeddings, norm and output
    may be None on stages that do not own them (`pipeline_stage`). A tied model's last pipeline
    stage keeps tok_embeddings for its weight but does not embed (`embeds_tokens` is False).
    """

    def __init__(self, args: LlamaModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.embeds_tokens = True  # False on pipeline stages that take the hidden state
        self.stage_role = "whole model"
        self.runtime = default_runtime(self.layers, CausalAttention)
        # Called with each block's name and output, and while its `recording` is true with the
        # block's attention and feed-forward branches too (metrics.fingerprints,
        # trainer/metrics/fingerprints.py); it runs here, outside the blocks, which may be compiled or
        # recompute their forward. Set by attach_probe.
        self.block_probe = None
        self.register_buffer("freqs_cis", rope_table(args), persistent=False)
        self.apply_runtime(self.runtime)

    def apply_runtime(self, runtime: ModelRuntime) -> None:
        """Compute as `runtime` says from now on: its blocks (by name, every block of this model
        or stage), the final norm's weight and the compute dtype (runtime.py)."""
        if [name for name, _ in runtime.blocks] != list(self.layers):
            raise ValueError(f"runtime for blocks {[n for n, _ in runtime.blocks]}, model has {list(self.layers)}")
        for name, block_runtime in runtime.blocks:
            self.layers[name].apply_runtime(block_runtime)
        if self.norm is not None:
            self.norm.weight_hook = runtime.final_norm_weights.hook if runtime.final_norm_weights else None
        for module in self.modules():
            if isinstance(module, CastsWeights):
                module.compute_dtype = runtime.compute_dtype
        self.runtime = replace(runtime, stage_role=self.stage_role)

    def describe(self) -> list[str]:
        """How this model computes, one line for the model and one per run of alike blocks."""
        return self.runtime.describe()

    def attach_probe(self, probe) -> None:
        """Call `probe` with every block's output (see block_probe); None detaches it."""
        self.block_probe = probe

    def pipeline_stage(self, blocks: set[str], first: bool, last: bool) -> "Transformer":
        """A copy (on the meta device) holding only the modules of a pipeline stage: `blocks`,
        the embedding on the first stage, the final norm and output layer on the last."""
        part = copy.deepcopy(self)
        for name in [n for n in part.layers if n not in blocks]:
            del part.layers[name]
        part.embeds_tokens = first
        # A tied output layer needs the embedding's weight: the last stage keeps its own copy,
        # whose gradient is summed with the first stage's after backward (TiedEmbeddings).
        if not first and not (last and self.args.tie_embeddings):
            part.tok_embeddings = None
        if not last:
            part.norm = None
            part.output = None
        part.stage_role = ("whole model" if first and last else "first pipeline stage" if first
                           else "last pipeline stage" if last else "middle pipeline stage")
        part.runtime = replace(self.runtime, blocks=tuple((n, block.runtime) for n, block in part.layers.items()),
                               stage_role=part.stage_role)
        return part

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). A pipeline stage without the embedding takes the
        hidden state (B, T, dim) instead, and one without the output returns it. documents
        (B, T, the whole sequence under context parallelism; see document_index): attention
        within documents only."""
        tied = self._tied_weight_cast()
        h = tokens
        if self.embeds_tokens:
            h = self.tok_embeddings(tokens, tied)
            if self.runtime.embedding_output is not None:
                h = self.runtime.embedding_output(h)
        probe = self.block_probe
        branches = probe is not None and probe.recording
        for name, block in self.layers.items():
            if branches:
                h, attention, ffn = block(h, self.freqs_cis, documents, branches=True)
                probe(name, h, attention, ffn)
            else:
                h = block(h, self.freqs_cis, documents)
                if probe is not None:
                    probe(name, h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, tied) if self.output is not None else h

    def _tied_weight_cast(self) -> torch.Tensor | None:
        """A tied weight under a compute dtype (ModelRuntime.compute_dtype), cast once for both of its uses: the gradients of
        the embedding and the output layer then add up in the compute dtype before reaching the
        stored weight, as they do on the one copy FSDP casts. None otherwise."""
        embedding = self.tok_embeddings
        if not (self.args.tie_embeddings and self.embeds_tokens and self.output is not None
                and embedding is not None and embedding.compute_dtype is not None):
            return None
        return embedding.cast(embedding.weight)

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        """Materialize on `device`. Moving off the meta device gives each module a new parameter,
        which would untie a tied output layer: tie it again (FSDP keeps shared parameters
        shared itself; setting the same parameter again changes nothing there)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def tie_weights(self) -> None:
        """A tied output layer uses the embedding's weight again (after something gave each its own
        copy: materializing, or tensor parallelism distributing both)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    # -----------------------------------------------------------------------------------------
    # Initialization

    def init_std(self, name: str) -> tuple[float, bool] | None:
        """(std, truncated) of the normal a parameter is drawn from; None for ones (norm weights)."""
        args = self.args
        leaf = name.split(".")[-2]
        if name.startswith("tok_embeddings"):
            # Tied, it is also the output layer: drawn as that layer is, so that the logits of a
            # unit-RMS hidden state start at about unit scale instead of sqrt(dim).
            return (args.dim ** -0.5, True) if args.tie_embeddings else (1.0, False)
        if name.startswith("output"):
            return args.dim ** -0.5, True
        if leaf in ("wq", "wk", "wv", "w1", "w3"):
            return 0.02, True
        if leaf in ("wo", "w2"):  # residual-stream writers: scale down with depth
            return 0.02 / math.sqrt(2 * args.n_layers), True
        return None

    @torch.no_grad()
    def init_weights(self, seed: int, device: torch.device | str | None = None) -> None:
        """Fill every parameter deterministically from (seed, name), whatever its sharding. Drawn in
        float32 and rounded to the parameter's dtype (bfloat16 under training.dtype), so every
        dtype starts from the same weights up to that rounding."""
        for name, param in self.named_parameters():
            full = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            spec = self.init_std(name)
            if spec is None:
                full.fill_(1.0)
            else:
                std, truncated = spec
                generator = torch.Generator(device=full.device).manual_seed(parameter_seed(seed, name))
                if truncated:
                    truncated_normal_(full, std=std, bound=3.0, generator=generator)
                else:
                    nn.init.normal_(full, std=std, generator=generator)
            copy_global_into(param, full)
        device = device if device is not None else self.freqs_cis.device
        self.freqs_cis = rope_table(self.args, device)


def count_params_on_meta(args: LlamaModelArgs) -> int:
    """Parameters of the model, counted without allocating any memory."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())
