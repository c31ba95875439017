"""The [quantize.linear.float8] table: float8 training of the blocks' linear layers (torchao).

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported. The table only
describes how; model.converters turns float8 on (torchtitan's split, kept so that its configs
load here unchanged: its 8B and 70B presets carry this table with the converter off).
The keys nest as in torchtitan: `--quantize.linear.float8.recipe_name rowwise` on the command
line, `[quantize.linear.float8]` in a TOML file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

# model.converters' names of the float8 converter: torchtitan v0.2.2's, and the earlier one its
# own 405B preset still uses.
FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")


@dataclass
class Float8Linear:
    """Float8 linear layers (torchao.float8), on when model.converters names them: every linear
    layer of the transformer blocks computes its three matmuls (forward, input gradient, weight
    gradient) on float8 operands with dynamic scales; the weights, their gradients and the
    optimizer stay in high precision. The output projection, the linears whose dimensions are not
    multiples of 16 and those filter_fqns names stay in high precision."""

    enable_fsdp_float8_all_gather: bool = False
    """Tensorwise scaling only: FSDP casts each weight shard to float8 before it all-gathers the
    weights (half the bytes of bfloat16), with the scale from the whole weight's absolute maximum."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: compute every weight's scale in one all-reduce after
    each optimizer step, instead of one per weight in the next forward. Without it: no effect."""

    recipe_name: Optional[Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]] = None
    """torchao's scaling recipe: tensorwise (one scale per tensor), rowwise (one per row: more
    accurate, slower), rowwise_with_gw_hp (rowwise, with the weight gradient in high precision).
    Unset: tensorwise, with enable_fsdp_float8_all_gather as set (a recipe name excludes it)."""

    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers to keep in high precision: any whose name contains one of these (for example
    "attention.wk,attention.wv"). "auto_filter_small_kn" also keeps those whose shapes are too
    small for float8 to pay off on an H100 (torchao's table for the recipe)."""

    emulate: bool = False
    """Compute the float8 matmuls in float32 on float8-rounded operands instead of float8 kernels:
    for GPUs without float8 kernels (before compute capability 8.9). Not with compile.enable."""


@dataclass
class QuantizeLinear:
    """Low-precision linear layers."""

    float8: Float8Linear = field(default_factory=Float8Linear)
    """[quantize.linear.float8]: float8 linear layers."""


@dataclass
class Quantize:
    """Low-precision training (torchtitan's [quantize] tables; MX and grouped matmuls are MoE's
    and are ignored with a warning)."""

    linear: QuantizeLinear = field(default_factory=QuantizeLinear)
    """[quantize.linear.*]: low-precision linear layers."""
