"""Tensor parallelism for a block's float8 layers: torchao's float8 styles (tensorwise scaling).

A block's input is split along the sequence (sequence parallelism) and all-gathered before its
attention and FFN. With float8 layers, torchao's styles cast it to float8 first, so the
all-gather moves one byte per element instead of two (bf16) or four, and cast it once for the
three attention projections (or the two FFN gates). The cast scales by the absolute maximum of
the whole sequence (an all-reduce over the TP ranks), as one process does; the backward casts the
gradients of each layer's output the same way before their all-gather. Rowwise recipes scale per
row, which these styles do not do: their layers are split with the plain styles and gather in high
precision.

gloo carries no float8 dtype ("Invalid scalar type"): over gloo the float8 all-gathers move the
same bytes as uint8 (`carry_float8_over_gloo`). NCCL carries float8 itself.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

# Each group of a block: its column-wise layers (they share its gathered input), its row-wise one.
GROUPS = {"attention": (("wq", "wk", "wv"), "wo"), "feed_forward": (("w1", "w3"), "w2")}


def tensorwise_float8(module) -> bool:
    """Whether `module` is a float8 layer that scales whole tensors (what torchao's TP styles cast)."""
    from trainer.float8 import import_float8

    import_float8()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    config, tensorwise = module.config, ScalingGranularity.TENSORWISE
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(cast.scaling_granularity is tensorwise for cast in casts)


def float8_styles() -> tuple:
    """torchao's (input preparation, column-wise, row-wise) styles for float8 layers."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return PrepareFloat8ModuleInput, Float8ColwiseParallel, Float8RowwiseParallel


def group_plan(group, name: str, input_layouts, desired_input_layouts, output_layouts, float8: bool) -> dict:
    """The TP plan of one block group (`name`: "attention" or "feed_forward"): column-wise layers on
    the gathered input, the row-wise one out to `output_layouts`. With float8 layers (`float8`),
    torchao's float8 styles for those that scale whole tensors, and the group's input cast to
    float8 before its all-gather when all its column-wise layers are such; plain styles otherwise
    (torchao is not imported)."""
    colwise, rowwise = GROUPS[name]
    in_float8 = {layer: float8 and tensorwise_float8(group.get_submodule(layer)) for layer in (*colwise, rowwise)}
    prepare, column, row = float8_styles() if any(in_float8.values()) else (None, None, None)
    gathers_float8 = all(in_float8[layer] for layer in colwise)
    plan = {name: (prepare if gathers_float8 else PrepareModuleInput)(input_layouts=input_layouts,
                                                                      desired_input_layouts=desired_input_layouts)}
    for layer in colwise:
        plan[f"{name}.{layer}"] = (column if in_float8[layer] else ColwiseParallel)()
    plan[f"{name}.{rowwise}"] = (row if in_float8[rowwise] else RowwiseParallel)(output_layouts=output_layouts)
    return plan


def carry_float8_over_gloo() -> None:
    """Let torchao's float8 all-gather run on gloo: its handler calls the collective on the float8
    bytes viewed as uint8 and views the result back (the same bytes NCCL would move). Installed
    once per process; a torchao without that handler is named."""
    from trainer.float8 import import_float8

    import_float8()
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE as table

    all_gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    handler = table.get(all_gather)
    if handler is None:
        raise RuntimeError("float8 tensor parallelism over gloo: this torchao has no float8 all-gather handler "
                           "(torchao.float8.float8_ops); use torchao>=0.18 or a NCCL backend")
    if getattr(handler, "carries_bytes", False):
        return

    @functools.wraps(handler)
    def as_bytes(op, args, kwargs=None):
        def gather_bytes(data, *rest, **options):
            return op(data.view(torch.uint8), *rest, **options).view(data.dtype)

        return handler(gather_bytes, args, kwargs)

    as_bytes.carries_bytes = True
    table[all_gather] = as_bytes
