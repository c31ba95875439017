"""Parameter names and layouts: this model's state dict <-> a Hugging Face Llama's.

Besides the names there is one difference: Hugging Face rotates the two HALVES of each head's
query/key vector (rotate_half), while this model rotates interleaved PAIRS (0,1), (2,3), ... So
the rows of wq and wk are permuted on the way in and back on the way out; everything else maps
1:1. A tied model (tie_word_embeddings) has no lm_head.weight: its output is the embedding.
"""

from __future__ import annotations

import torch

from trainer.models.llama3.args import LlamaModelArgs


class HFCheckpointError(ValueError):
    """A Hugging Face folder that cannot be used for this model; the message names it."""


def _layer_map(i: int) -> dict[str, str]:
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    return {
        ours + "attention.wq.weight": theirs + "self_attn.q_proj.weight",
        ours + "attention.wk.weight": theirs + "self_attn.k_proj.weight",
        ours + "attention.wv.weight": theirs + "self_attn.v_proj.weight",
        ours + "attention.wo.weight": theirs + "self_attn.o_proj.weight",
        ours + "feed_forward.w1.weight": theirs + "mlp.gate_proj.weight",
        ours + "feed_forward.w3.weight": theirs + "mlp.up_proj.weight",
        ours + "feed_forward.w2.weight": theirs + "mlp.down_proj.weight",
        ours + "attention_norm.weight": theirs + "input_layernorm.weight",
        ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
    }


def key_map(args: LlamaModelArgs) -> dict[str, str]:
    """Our parameter name -> Hugging Face parameter name, one entry per stored tensor."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        names.update(_layer_map(i))
    return names


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from interleaved pairs to halves (ours -> Hugging Face)."""
    head_dim = w.shape[0] // heads
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // heads
    return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def _rope_heads(ours: str, args: LlamaModelArgs) -> int | None:
    """Heads whose rows a weight's RoPE layout spans (wq, wk), else None."""
    if ours.endswith("attention.wq.weight"):
        return args.n_heads
    if ours.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def permutes_rows(ours: str, args: LlamaModelArgs) -> bool:
    """Whether converting this tensor copies it (wq and wk: the RoPE row order)."""
    return _rope_heads(ours, args) is not None


def _convert(w: torch.Tensor, heads: int | None, permute) -> torch.Tensor:
    return (permute(w, heads) if heads else w).contiguous()


def to_hf_tensor(ours: str, w: torch.Tensor, args: LlamaModelArgs) -> torch.Tensor:
    """One of our tensors in Hugging Face layout (its name there is key_map(args)[ours]). Only wq
    and wk are copied (row permutation); any other tensor comes back as it is."""
    return _convert(w, _rope_heads(ours, args), _pairs_to_halves)


def to_hf(state: dict[str, torch.Tensor], args: LlamaModelArgs) -> dict[str, torch.Tensor]:
    return {theirs: to_hf_tensor(ours, state[ours], args) for ours, theirs in key_map(args).items()}


def from_hf(state: dict[str, torch.Tensor], args: LlamaModelArgs, source: str = "") -> dict[str, torch.Tensor]:
    """Our state dict from Hugging Face tensors. A tied model's folder may still hold an
    lm_head.weight (some writers store the alias): it must then equal the embedding."""
    out = {}
    for ours, theirs in key_map(args).items():
        if theirs not in state:
            raise HFCheckpointError(f"{source}: missing tensor {theirs} (needed for {ours})")
        out[ours] = _convert(state[theirs], _rope_heads(ours, args), _halves_to_pairs)
    head = state.get("lm_head.weight")
    if args.tie_embeddings and head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
        raise HFCheckpointError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                                "model.embed_tokens.weight; set tie_word_embeddings to false in its config.json "
                                "(and use a flavor with an untied output) or drop lm_head.weight")
    return out
