"""LR schedule values, optimizer construction and global-norm clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trainer.config.job_config import LRScheduler, Optimizer
from trainer.optim import NormReduction, build_lr_scheduler, build_optimizer, clip_grad_norm, lr_factor


def factors(total, warmup, ratio, kind, floor):
    return [lr_factor(s, total_steps=total, warmup_steps=warmup, decay_ratio=ratio, decay_type=kind,
                      min_lr_factor=floor) for s in range(1, total + 1)]


def test_warmup_stable_linear_decay():
    got = factors(12, 4, 0.5, "linear", 0.1)
    expected = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]
    assert got == pytest.approx(expected, abs=1e-12)


def test_decay_shapes_at_quarter_progress():
    # 4 decay steps after 8 (warmup + stable): step 9 is a quarter of the way down.
    assert factors(12, 4, 0.5, "cosine", 0.1)[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert factors(12, 4, 0.5, "sqrt", 0.1)[8] == pytest.approx(0.1 + 0.9 * 0.5)


def test_no_decay_ratio_decays_over_all_post_warmup_steps():
    got = factors(6, 2, None, "linear", 0.0)
    assert got == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_warmup_longer_than_training_never_reaches_peak():
    got = factors(3, 10, None, "linear", 0.0)
    assert got == pytest.approx([0.1, 0.2, 0.3])


def test_zero_warmup_starts_at_peak():
    assert factors(4, 0, None, "linear", 0.0)[0] == pytest.approx(0.75)


def test_scheduler_applies_factor_of_each_step():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([("w", param)], Optimizer(lr=0.1))
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=4, decay_ratio=0.5, min_lr_factor=0.1), 12)
    used = []
    for _ in range(12):
        used.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([0.1 * f for f in factors(12, 4, 0.5, "linear", 0.1)])


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
def test_optimizer_from_config(name, cls):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([("w", param)], Optimizer(name=name, lr=0.5, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2))
    assert cls in type(optimizer).__bases__  # torch's, stepping on local shards (trainer/local_shards.py)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.5, (0.8, 0.9), 1e-6, 0.2)


def tiny_model():
    from trainer.models.llama3.args import get_flavor
    from trainer.models.llama3.model import Transformer

    torch.manual_seed(0)
    return Transformer(get_flavor("tiny"))


def group_names(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [sorted(names[id(p)] for p in group["params"]) for group in optimizer.param_groups]


def test_nothing_excluded_keeps_one_group_of_every_parameter():
    model = tiny_model()
    optimizer = build_optimizer(model.named_parameters(), Optimizer(weight_decay=0.1))
    assert group_names(model, optimizer) == [sorted(n for n, _ in model.named_parameters())]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("exclude, expected", [
    (["norm"], {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "layers.1.attention_norm.weight",
                "layers.1.ffn_norm.weight", "layers.2.attention_norm.weight", "layers.2.ffn_norm.weight",
                "layers.3.attention_norm.weight", "layers.3.ffn_norm.weight", "norm.weight"}),
    (["embedding", "output"], {"tok_embeddings.weight", "output.weight"}),
    (["bias"], set()),  # Llama has no biases: one decayed group, as without exclusions
])
def test_excluded_kinds_form_a_group_without_decay(exclude, expected):
    model = tiny_model()
    optimizer = build_optimizer(model.named_parameters(), Optimizer(weight_decay=0.1, weight_decay_exclude=exclude))
    everything = {n for n, _ in model.named_parameters()}
    groups = group_names(model, optimizer)
    assert groups == ([sorted(everything - expected), sorted(expected)] if expected else [sorted(everything)])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0][:len(groups)]


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_excluded_parameters_are_not_decayed(name):
    """With zero gradients the only update is weight decay: AdamW scales a decayed weight by exactly
    1 - lr x weight_decay, Adam's L2 term moves it; an excluded weight stays bitwise unchanged."""
    model = tiny_model()
    cfg = Optimizer(name=name, lr=0.1, weight_decay=0.5, weight_decay_exclude=["norm", "embedding"])
    optimizer = build_optimizer(model.named_parameters(), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        if n == "tok_embeddings.weight" or n.endswith("norm.weight"):
            assert torch.equal(p, before[n]), n
        elif name == "AdamW":
            assert torch.equal(p, before[n] * (1 - 0.1 * 0.5)), n
        else:
            assert not torch.equal(p, before[n]), n


def test_clip_grad_norm_returns_global_norm_and_clips():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    clipped = torch.cat([a.grad, b.grad]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-5)


def test_clip_disabled_still_reports_norm():
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([6.0, 8.0])
    assert clip_grad_norm([a], max_norm=0.0).item() == pytest.approx(10.0)
    assert a.grad.tolist() == [6.0, 8.0]


def test_norm_accumulates_in_float64_whatever_the_gradient_dtype():
    a = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    a.grad = torch.tensor([3.0, 4.0, 12.0], dtype=torch.bfloat16)
    norm = clip_grad_norm([a], max_norm=0.0)
    assert norm.dtype == torch.float64 and norm.item() == 13.0


def test_the_norm_does_not_depend_on_how_the_gradients_are_split():
    """torch's float32 norm kernel on the CPU (torch 2.13) is off by 8.5e-5 relative over these 4M
    elements, and differently for each split into shards, which made the gradient norms of layouts
    differ by 3e-5 to 5e-5 while their losses agreed within 1e-6. Accumulated in float64, the norm
    of one whole tensor and the norm over 2, 4 or 8 shards agree with the exact value to 1e-12."""
    torch.manual_seed(0)
    whole = torch.randn(2 ** 22) * 1e-3
    exact = whole.double().square().sum().sqrt().item()
    for shards in (1, 2, 4, 8):
        params = []
        for piece in whole.chunk(shards):
            p = torch.nn.Parameter(torch.zeros_like(piece))
            p.grad = piece.clone()
            params.append(p)
        assert abs(clip_grad_norm(params, max_norm=0.0).item() - exact) / exact < 1e-12, shards


def test_plain_gradients_are_refused_when_ranks_share_a_stage():
    """A plain tensor does not say which ranks hold copies of it: counting it would be a guess."""
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="plain-tensor gradient"):
        clip_grad_norm([a], max_norm=1.0, reduce=NormReduction(group=None, ranks_per_stage=2))


def test_state_created_up_front_trains_like_the_lazy_state_and_survives_a_save():
    """build_optimizer creates Adam's state as the first step would; saving it before any step
    (torch's distributed state_dict otherwise runs a step to create it) leaves the step count at 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from trainer.config.manager import load_config

    cfg = load_config(["--optimizer.weight_decay", "0.1"]).optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    lazy_model = copy.deepcopy(model)
    eager = build_optimizer(model.named_parameters(), cfg)
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=cfg.implementation == "foreach")
    assert all(float(s["step"]) == 0 for s in eager.state.values()) and len(eager.state) == 4
    get_optimizer_state_dict(model, eager)  # a save before the first step
    assert all(float(s["step"]) == 0 for s in eager.state.values())
    for _ in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for m, o in ((model, eager), (lazy_model, lazy)):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), lazy_model.parameters()))


# ---------------------------------------------------------------------------------------------
# lr_scheduler.total_steps: the schedule's horizon, independent of training.steps


def learning_rates(cfg: LRScheduler, training_steps: int, steps: int, start_from=None) -> list[float]:
    """The learning rates of optimizer steps 1..steps (or, from a saved scheduler state, of the
    steps after it), as the trainer's scheduler gives them."""
    from trainer.optim import set_schedule_position

    optimizer = build_optimizer([("w", torch.nn.Parameter(torch.zeros(1)))], Optimizer(lr=0.1))
    scheduler = build_lr_scheduler(optimizer, cfg, training_steps)
    if start_from is not None:
        scheduler.load_state_dict(start_from)
        set_schedule_position(scheduler, scheduler.last_epoch)
    used = []
    for _ in range(steps):
        used.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return used


def test_total_steps_lays_the_schedule_out_whatever_training_steps_is():
    cfg = LRScheduler(warmup_steps=4, total_steps=20, decay_ratio=0.5, min_lr_factor=0.1)
    long = learning_rates(cfg, 20, 20)
    assert long == pytest.approx([0.1 * f for f in factors(20, 4, 0.5, "linear", 0.1)], abs=1e-15)
    assert learning_rates(cfg, 8, 8) == long[:8]  # stopped early: the first 8 steps of the long run
    # Past the horizon the learning rate stays at its floor.
    assert learning_rates(cfg, 25, 25)[19:] == pytest.approx([0.1 * 0.1] * 6, abs=1e-15)
    # Unset: the horizon is training.steps, as before.
    assert learning_rates(LRScheduler(warmup_steps=4, decay_ratio=0.5, min_lr_factor=0.1), 20, 20) == long


def test_a_run_with_a_horizon_is_extended_exactly():
    """Train 8 of 20 steps, save the scheduler, resume with training.steps raised to 20: the
    learning rates are those of one 20-step run, and the resume says nothing changed."""
    from trainer.config.manager import load_config, to_dict
    from trainer.optim import schedule_change

    cfg = LRScheduler(warmup_steps=4, total_steps=20, decay_ratio=0.5)
    optimizer = build_optimizer([("w", torch.nn.Parameter(torch.zeros(1)))], Optimizer(lr=0.1))
    first = build_lr_scheduler(optimizer, cfg, 8)
    for _ in range(8):
        optimizer.step()
        first.step()
    resumed = learning_rates(cfg, 20, 12, start_from=first.state_dict())
    assert resumed == learning_rates(cfg, 20, 20)[8:]
    horizon = ["--lr_scheduler.warmup_steps", "4", "--lr_scheduler.total_steps", "20", "--lr_scheduler.decay_ratio",
               "0.5"]
    saved = to_dict(load_config(["--training.steps", "8", *horizon]))
    assert schedule_change(saved, load_config(["--training.steps", "20", *horizon]), 8) is None
    # Without the horizon, the first run decayed over its own 8 steps: the resume names it.
    saved = to_dict(load_config(["--training.steps", "8", *horizon[:2], *horizon[4:]]))
    message = schedule_change(saved, load_config(["--training.steps", "20", *horizon]), 8)
    assert message.startswith("steps 7-8 were trained with the learning-rate schedule of training.steps = 8, which "
                              "differs from this run's (lr_scheduler.total_steps = 20)")
    assert "lr_scheduler.total_steps set from the first start fixes the schedule" in message


def test_a_key_the_saved_run_left_unset_is_compared_as_unset():
    """A saved record omits unset (None) keys: they are their defaults, not this run's values."""
    from trainer.config.manager import load_config, to_dict
    from trainer.optim import schedule_change

    saved = to_dict(load_config(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2"]))
    now = load_config(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio",
                       "0.5"])
    assert schedule_change(saved, now, 6).startswith("steps 3-6 were trained with the learning-rate schedule")
