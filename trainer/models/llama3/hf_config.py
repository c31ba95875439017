"""Hugging Face `config.json` <-> the model's shapes (LlamaModelArgs), and the one place a
configured model.flavor becomes shapes (`model_args`), "hf" included.

No torch import: the config validator and the launcher's preflight read shapes in a light process.
"""

from __future__ import annotations

import json
import math
import reprlib
from pathlib import Path

from trainer.models.llama3.args import FLAVORS, LlamaModelArgs, RopeScaling, get_flavor

HF_FLAVOR = "hf"  # model.flavor whose shapes come from model.hf_assets_path/config.json
# How a message quotes a value of config.json: whole, unless it is long (the file may hold anything).
QUOTE = reprlib.Repr()
QUOTE.maxstring = QUOTE.maxother = 160


class HFConfigError(ValueError):
    """A config.json this model cannot follow; the message names the file and each field."""


# The type and range of each config.json field the shapes are built from, checked before any is read.
SIZE_MAX = 2**31 - 1  # a dimension beyond this is not a model this trainer can hold
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
         "num_key_value_heads", "head_dim")
POSITIVE = ("rms_norm_eps", "rope_theta")
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
NAMES = ("hidden_act", "model_type")
ROPE_TABLES = ("rope_scaling", "rope_parameters")
LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problem(field: str, value, what: str) -> str:
    return f"{field} = {QUOTE.repr(value)} is not {what}"


def _rope_problems(name: str, table) -> list[str]:
    """rope_scaling / rope_parameters: an object or null; Llama 3 scaling needs its factors."""
    if table is None:
        return []
    if not isinstance(table, dict):
        return [_problem(name, table, "an object or null")]
    problems = []
    for key in ("rope_type", "type"):
        if table.get(key) is not None and not isinstance(table[key], str):
            problems.append(_problem(f"{name}.{key}", table[key], "a string"))
    if "rope_theta" in table and not (_number(table["rope_theta"]) and table["rope_theta"] > 0):
        problems.append(_problem(f"{name}.rope_theta", table["rope_theta"], "a finite number > 0"))
    if "llama3" in (table.get("rope_type"), table.get("type")):
        for key in LLAMA3_FACTORS:
            value = table.get(key)
            if not (_number(value) and value > 0):
                problems.append(_problem(f"{name}.{key}", value, "a finite number > 0"))
        original = table.get("original_max_position_embeddings")
        if not (_integer(original) and 1 <= original <= SIZE_MAX):
            problems.append(_problem(f"{name}.original_max_position_embeddings", original, "an integer >= 1"))
    return problems


def config_problems(config: dict) -> list[str]:
    """Each field of a config.json whose value has the wrong type or range (absent or null fields
    are left to hf_config, which says which it needs)."""
    problems = []
    for field in SIZES:
        value = config.get(field)
        if value is not None and not (_integer(value) and 1 <= value <= SIZE_MAX):
            problems.append(_problem(field, value, "an integer >= 1"))
    for field in POSITIVE:
        value = config.get(field)
        if value is not None and not (_number(value) and value > 0):
            problems.append(_problem(field, value, "a finite number > 0"))
    for field in FLAGS:
        value = config.get(field)
        if value is not None and not isinstance(value, bool):
            problems.append(_problem(field, value, "true or false"))
    for field in NAMES:
        value = config.get(field)
        if value is not None and not isinstance(value, str):
            problems.append(_problem(field, value, "a string"))
    dropout = config.get("attention_dropout")
    if dropout is not None and not (_number(dropout) and 0 <= dropout <= 1):
        problems.append(_problem("attention_dropout", dropout, "a number in [0, 1]"))
    for name in ROPE_TABLES:
        problems += _rope_problems(name, config.get(name))
    return problems


def read_config_json(folder: str | Path, key: str = "model.hf_assets_path") -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise HFConfigError(f"{key}: {folder} is not a folder")
    if not path.is_file():
        raise HFConfigError(f"{key}: {folder} has no config.json (a Hugging Face model folder holds one)")
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, an int of 5000 digits
        raise HFConfigError(f"{path}: not readable JSON ({str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return config


def model_args(flavor: str, hf_assets_path: str = "") -> LlamaModelArgs:
    """The shapes of a configured model: a shipped flavor, or "hf": those of hf_assets_path/config.json."""
    if flavor != HF_FLAVOR:
        return get_flavor(flavor)
    if not hf_assets_path:
        raise HFConfigError('model.flavor = "hf" takes the shapes from model.hf_assets_path/config.json; '
                            "set model.hf_assets_path to a Hugging Face model folder")
    return args_from_hf_config(read_config_json(hf_assets_path), f"{hf_assets_path}/config.json")


def configured_model_args(model) -> LlamaModelArgs:
    """The shapes a job's [model] section configures (model.flavor, model.hf_assets_path)."""
    return model_args(model.flavor, model.hf_assets_path)


def flavor_names() -> list[str]:
    return [*FLAVORS, HF_FLAVOR]


# ---------------------------------------------------------------------------------------------
# config.json -> shapes


def _rope(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling parameters or None) from either transformers layout: v4's rope_theta and
    rope_scaling, or v5's rope_parameters (which holds rope_theta too)."""
    parameters = config.get("rope_parameters") or {}
    theta = next((t for t in (config.get("rope_theta"), parameters.get("rope_theta")) if t is not None), 10000.0)
    scaling = config.get("rope_scaling") or None
    if scaling is None and parameters.get("rope_type", "default") != "default":
        scaling = parameters
    return float(theta), scaling


def unsupported_fields(config: dict) -> list[str]:
    """Each field of a config.json that asks for something this Llama does not compute."""
    problems = []
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            problems.append(f"{bias} = true (this model's linear layers have no biases)")
    for window in ("sliding_window", "use_sliding_window"):
        if config.get(window) not in (None, False):
            problems.append(f"{window} = {QUOTE.repr(config[window])} (attention here is full causal, no sliding "
                            "window)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act = {QUOTE.repr(act)} (the FFN is SwiGLU: silu)")
    if config.get("attention_dropout"):
        problems.append(f"attention_dropout = {config['attention_dropout']} (no dropout here)")
    _, scaling = _rope(config)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "default"):
            problems.append(f"rope_scaling type {QUOTE.repr(kind)} (supported: Llama 3's 'llama3' frequency scaling, "
                            "or none)")
    heads, dim = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and dim and head_dim * heads != dim:
        problems.append(f"head_dim = {head_dim} (this model's heads split hidden_size: {dim} / {heads} heads)")
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        problems.append(f"model_type = {QUOTE.repr(model_type)} (supported: 'llama', the LlamaForCausalLM "
                        "architecture)")
    return problems


def args_from_hf_config(config: dict, source: str) -> LlamaModelArgs:
    """The shapes of any Llama-architecture config.json; unsupported fields are refused by name."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise HFConfigError(f"{source}: missing or not an integer: {', '.join(missing)}")
    wrong = config_problems(config)  # each field's type and range, before a value is read
    if wrong:
        raise HFConfigError(f"{source}: " + "; ".join(wrong))
    problems = unsupported_fields(config)
    if problems:
        raise HFConfigError(f"{source}: this trainer's Llama cannot follow " + "; ".join(problems))
    theta, scaling = _rope(config)
    eps = config.get("rms_norm_eps")  # null: as if absent
    rope_scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_scaling = RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                                   high_freq_factor=float(scaling["high_freq_factor"]),
                                   original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    args = LlamaModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], multiple_of=1, ffn_dim=config["intermediate_size"],
        norm_eps=float(1e-6 if eps is None else eps), rope_theta=theta, rope_scaling=rope_scaling,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    try:
        args.validate()
    except ValueError as e:
        raise HFConfigError(f"{source}: {e}") from None
    return args


# ---------------------------------------------------------------------------------------------
# shapes -> config.json, and the check that a folder matches the configured shapes


def hf_config(args: LlamaModelArgs, dtype_name: str = "float32") -> dict:
    """The config.json `save_pretrained` would write for these shapes. max_position_embeddings is
    the trained length, at least the RoPE scaling's original context (transformers expects that)."""
    scaled_from = args.rope_scaling.original_max_position_embeddings if args.rope_scaling is not None else 0
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": max(args.max_seq_len, scaled_from), "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype_name,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
    return config


def hf_config_differences(config: dict, args: LlamaModelArgs, source: str) -> list[str]:
    """Each config.json field whose value differs from the configured model, with both values."""
    theirs = args_from_hf_config(config, source)
    fields = {
        "hidden_size": (args.dim, theirs.dim),
        "intermediate_size": (args.ffn_hidden_dim, theirs.ffn_hidden_dim),
        "num_hidden_layers": (args.n_layers, theirs.n_layers),
        "num_attention_heads": (args.n_heads, theirs.n_heads),
        "num_key_value_heads": (args.kv_heads, theirs.kv_heads),
        "vocab_size": (args.vocab_size, theirs.vocab_size),
        "rope_theta": (args.rope_theta, theirs.rope_theta),
        "tie_word_embeddings": (args.tie_embeddings, theirs.tie_embeddings),
    }
    return [f"{key} = {found} (the configured model has {wanted})"
            for key, (wanted, found) in fields.items() if wanted != found]


def check_hf_config(config: dict, args: LlamaModelArgs, source: str) -> None:
    """Refuse a config.json whose model differs from the configured one, naming each difference."""
    wrong = hf_config_differences(config, args, source)
    if wrong:
        raise HFConfigError(f"{source} does not match the configured model.flavor: " + "; ".join(wrong)
                            + '. To build the model from its shapes, use flavor "hf" with this folder (in a job: '
                            'model.flavor = "hf" and model.hf_assets_path; in python -m trainer.hf: --flavor hf)')
