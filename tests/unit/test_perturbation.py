"""The noise controls' perturbation: rounding-level, zero-mean, seeded per parameter, matrices only."""

from __future__ import annotations

import pytest
import torch

from trainer.models.llama3 import Transformer, get_flavor
from trainer.model_build import perturb_weights, rounding_error


def tiny_model() -> Transformer:
    args = get_flavor("tiny")
    args.max_seq_len = 32
    model = Transformer(args)
    model.init_weights(seed=0, device="cpu")
    return model


def relative_changes(seed: int, rounding_errors: float = 1.0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    before = tiny_model()
    after = tiny_model()
    relative = perturb_weights(after, rounding_errors, dtype, seed)
    assert relative == rounding_errors * rounding_error(dtype)
    return {name: (p_after / p_before - 1) for (name, p_before), p_after in
            zip(before.named_parameters(), after.parameters())}


def test_rounding_errors_of_the_compute_dtypes():
    assert rounding_error(torch.bfloat16) == 2 ** -8
    assert rounding_error(torch.float16) == 2 ** -11
    assert rounding_error(torch.float32) == 2 ** -24


def test_matrices_move_by_at_most_the_perturbation_and_on_average_not_at_all():
    changes = relative_changes(seed=1)
    matrices = torch.cat([c.flatten() for name, c in changes.items() if c.dim() >= 2])
    assert matrices.abs().max() <= 2 ** -8 * (1 + 1e-6)
    assert matrices.abs().max() > 0.99 * 2 ** -8  # uniform over the whole range
    # zero mean: within 4 standard errors of a uniform's mean (sd 2^-8 / sqrt(3))
    assert abs(matrices.mean().item()) < 4 * 2 ** -8 / 3 ** 0.5 / matrices.numel() ** 0.5
    # the norm gains (exactly 1.0 at init) are left alone: perturbed, they would round only down in bf16
    vectors = [name for name, c in changes.items() if c.dim() < 2]
    assert vectors and all(changes[name].abs().max() == 0 for name in vectors)


def test_each_seed_gives_its_own_noise_and_the_same_seed_the_same():
    first, again, other = relative_changes(1), relative_changes(1), relative_changes(2)
    name = "layers.0.attention.wq.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    # fp32's rounding error is 2^16 times smaller than bf16's; the float32 factor 1 + x and the
    # product round too, so a weight moves by at most a unit or two in the last place
    tiny = relative_changes(1, dtype=torch.float32)[name].abs()
    assert 0 < tiny.max() <= 2 ** -22


def test_the_trainer_refuses_a_perturbation_out_of_range():
    from trainer.config.manager import ConfigError, load_config

    with pytest.raises(ConfigError, match="debug.init_perturbation: must be in \\[0, 64\\]"):
        load_config(["--debug.init_perturbation", "-1"])
