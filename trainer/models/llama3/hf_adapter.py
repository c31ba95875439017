"""Hugging Face Llama checkpoints (config.json + safetensors) <-> this model's weights.

Two differences besides names: Hugging Face rotates the two HALVES of each head's query/key
vector (rotate_half), while this model rotates interleaved PAIRS (0,1), (2,3), ... So the rows
of wq and wk are permuted on the way in and back on the way out; everything else maps 1:1.

    python -m trainer.models.llama3.hf_adapter import --hf HF_DIR --flavor 8B --out DCP_DIR
    python -m trainer.models.llama3.hf_adapter export --dcp DCP_DIR --flavor 8B --out HF_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from trainer.models.llama3.args import LlamaModelArgs, get_flavor


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
    """Our parameter name -> Hugging Face parameter name."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
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


def _convert(w: torch.Tensor, heads: int | None, permute) -> torch.Tensor:
    return (permute(w, heads) if heads else w).contiguous()


def to_hf(state: dict[str, torch.Tensor], args: LlamaModelArgs) -> dict[str, torch.Tensor]:
    return {theirs: _convert(state[ours], _rope_heads(ours, args), _pairs_to_halves)
            for ours, theirs in key_map(args).items()}


def from_hf(state: dict[str, torch.Tensor], args: LlamaModelArgs, source: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs in key_map(args).items():
        if theirs not in state:
            raise HFCheckpointError(f"{source}: missing tensor {theirs} (needed for {ours})")
        out[ours] = _convert(state[theirs], _rope_heads(ours, args), _halves_to_pairs)
    return out


# ---------------------------------------------------------------------------------------------
# config.json


def hf_config(args: LlamaModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
    return config


def check_config(config: dict, args: LlamaModelArgs, source: str) -> None:
    """Refuse a Hugging Face model whose shapes differ from the configured flavor, naming each."""
    rope = config.get("rope_parameters") or {}
    expected = {
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size,
    }
    found = dict(config)
    found.setdefault("num_key_value_heads", config.get("num_attention_heads"))  # Hugging Face's default
    wrong = [f"{k} = {found.get(k)} (model.flavor needs {v})" for k, v in expected.items() if found.get(k) != v]
    theta = config.get("rope_theta", rope.get("rope_theta"))
    if theta is not None and float(theta) != args.rope_theta:
        wrong.append(f"rope_theta = {theta} (model.flavor needs {args.rope_theta})")
    if config.get("tie_word_embeddings"):
        wrong.append("tie_word_embeddings = true (this model has an untied output layer)")
    if wrong:
        raise HFCheckpointError(f"{source}/config.json does not match the model: " + "; ".join(wrong))


# ---------------------------------------------------------------------------------------------
# Folders


def read_hf_folder(path: str | Path, args: LlamaModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict (full tensors, CPU) from a save_pretrained folder (single or sharded)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HFCheckpointError(f"{folder}: no config.json; expected a Hugging Face model folder")
    check_config(json.loads((folder / "config.json").read_text()), args, str(folder))
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (folder / name).is_file():
            raise HFCheckpointError(f"{folder}: missing {name}")
        state.update(load_file(str(folder / name)))
    return from_hf(state, args, str(folder))


def write_hf_folder(path: str | Path, state: dict[str, torch.Tensor], args: LlamaModelArgs,
                    dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors, as `save_pretrained` writes them."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf(state, args).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.checkpoint as dcp

    from trainer.dcp_files import read_model_state

    parser = argparse.ArgumentParser(prog="python -m trainer.models.llama3.hf_adapter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face folder -> model-only DCP checkpoint")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--flavor", required=True)
    imp.add_argument("--out", required=True, help="new checkpoint folder (use it as checkpoint.initial_load_path)")
    exp = commands.add_parser("export", help="DCP checkpoint -> Hugging Face folder")
    exp.add_argument("--dcp", required=True)
    exp.add_argument("--flavor", required=True)
    exp.add_argument("--out", required=True)
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a = parser.parse_args(argv)
    try:
        args = get_flavor(a.flavor)
        if Path(a.out).exists():
            raise HFCheckpointError(f"--out: {a.out} exists; choose a new folder")
        if a.command == "import":
            state = read_hf_folder(a.hf, args)
            dcp.save({"model": state}, checkpoint_id=a.out, no_dist=True)
        else:
            write_hf_folder(a.out, read_model_state(Path(a.dcp)), args, getattr(torch, a.dtype))
    except (HFCheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
