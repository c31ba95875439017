"""Tensor parallelism of float8 layers (trainer/parallel/float8_tp.py): which layers get torchao's
float8 styles, and how their float8 all-gather crosses gloo. Training with them is
tests/integration/test_float8_training.py (TP, and FSDP x TP with float8 all-gather)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

from trainer.parallel.float8_tp import carry_float8_over_gloo
from trainer.parallel.tensor import block_group_plan
from tests.unit.test_float8 import TINY, converted


def style_names(argv: list[str]) -> dict[str, str]:
    model, _ = converted(argv)
    return {name: type(style).__name__ for name, style in block_group_plan(model.layers["0"], float8=True).items()}


def test_tensorwise_float8_layers_gather_their_input_in_float8():
    assert style_names(TINY) == {
        "attention": PrepareFloat8ModuleInput.__name__, "attention.wq": Float8ColwiseParallel.__name__,
        "attention.wk": Float8ColwiseParallel.__name__, "attention.wv": Float8ColwiseParallel.__name__,
        "attention.wo": Float8RowwiseParallel.__name__,
        "feed_forward": PrepareFloat8ModuleInput.__name__, "feed_forward.w1": Float8ColwiseParallel.__name__,
        "feed_forward.w3": Float8ColwiseParallel.__name__, "feed_forward.w2": Float8RowwiseParallel.__name__}


def test_a_group_with_a_high_precision_layer_gathers_in_high_precision():
    styles = style_names([*TINY, "--quantize.linear.float8.filter_fqns", "attention.wk"])
    assert styles["attention"] == PrepareModuleInput.__name__ and styles["attention.wk"] == ColwiseParallel.__name__
    assert styles["attention.wq"] == Float8ColwiseParallel.__name__  # casts its own gathered input
    assert styles["feed_forward"] == PrepareFloat8ModuleInput.__name__


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_scaling_takes_the_plain_styles(recipe):
    styles = style_names([*TINY, "--quantize.linear.float8.recipe_name", recipe])
    plain = {PrepareModuleInput.__name__, ColwiseParallel.__name__, RowwiseParallel.__name__}
    assert set(styles.values()) == plain


def test_over_gloo_the_float8_all_gather_moves_the_same_bytes_as_uint8():
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

    all_gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    carry_float8_over_gloo()
    handler = FLOAT8_OPS_TABLE[all_gather]
    carry_float8_over_gloo()  # once per process: not wrapped twice
    assert FLOAT8_OPS_TABLE[all_gather] is handler

    data = torch.randn(4, 16).to(torch.float8_e5m2)
    tensor = Float8TrainingTensor(data, torch.tensor(2.0), torch.float32, LinearMMConfig(), GemmInputRole.GRAD_OUTPUT)
    seen = []

    def two_rank_gather(wire, group_size, group_name):  # what gloo would return from 2 ranks
        seen.append(wire.dtype)
        return torch.cat([wire, wire])

    gathered = handler(two_rank_gather, (tensor, 2, "tp"), {})
    assert seen == [torch.uint8]
    assert gathered._data.dtype == torch.float8_e5m2 and gathered._scale.item() == 2.0
    assert torch.equal(gathered._data.view(torch.uint8), torch.cat([data, data]).view(torch.uint8))
