"""The optimizer step and gradient scaling on local shards (trainer/local_shards.py) give bitwise
what torch's Adam, AdamW and clip_grads_with_norm_ give through DTensor, on 2 gloo ranks: uneven
row shards, column shards, a replicated parameter and a plain one, for every optimizer.implementation;
the state stays DTensors of each parameter's layout; no DTensor operation runs in a local step;
and a gradient of another layout (a Partial sum), or a closure, makes the whole step go through
DTensor."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.ranks import start_ranks
from trainer.local_shards import scale_gradients_
from trainer.optim import OPTIMIZERS

STEPS = 3
# (global shape, placement): 5 rows over 2 ranks is 3 and 2.
LAYOUTS = [((5, 4), Shard(0)), ((4, 6), Shard(1)), ((7,), Replicate())]


def parameters(mesh, seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)  # the same global values on every rank
    sharded = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [placement]))
               for shape, placement in LAYOUTS]
    return [*sharded, torch.nn.Parameter(torch.randn(3))]


def set_gradients(params, mesh, step: int) -> None:
    torch.manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape)
        p.grad = distribute_tensor(grad, mesh, p.placements) if isinstance(p, DTensor) else grad


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DTensorOps(TorchDispatchMode):
    """Records every operation given a DTensor while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs))):
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def compare_optimizers(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    try:
        for name, torch_class in (("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)):
            for implementation in ({"foreach": True}, {"foreach": False}, {"fused": True}):
                kwargs = dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, **implementation)
                ours, theirs = parameters(mesh, 0), parameters(mesh, 0)
                # torch's foreach step cannot mix DTensors and plain tensors in one group
                ours_opt = OPTIMIZERS[name]([{"params": ours[:-1]}, {"params": ours[-1:]}], **kwargs)
                theirs_opt = torch_class([{"params": theirs[:-1]}, {"params": theirs[-1:]}], **kwargs)
                for step in range(STEPS):
                    set_gradients(ours, mesh, step)
                    set_gradients(theirs, mesh, step)
                    with DTensorOps() as seen:
                        ours_opt.step()
                    theirs_opt.step()
                    assert seen.ops == [], (name, implementation, seen.ops)  # no DTensor operation ran
                    assert all(p._local_tensor.grad is None for p in ours[:-1])  # the shards keep no gradient
                    for a, b in zip(ours, theirs):
                        assert torch.equal(local(a), local(b)), (name, implementation, step)
                for a, b in zip(ours, theirs):
                    ours_state, theirs_state = ours_opt.state[a], theirs_opt.state[b]
                    assert set(ours_state) == set(theirs_state)
                    for key, value in ours_state.items():
                        expected = theirs_state[key]
                        assert type(value) is type(expected) and torch.equal(local(value), local(expected)), key
                        if isinstance(expected, DTensor):
                            assert (value.placements, value.shape, value.stride()) == \
                                   (expected.placements, expected.shape, expected.stride()), key
                assert ours_opt.state_dict()["param_groups"] == theirs_opt.state_dict()["param_groups"]

        # A gradient still owed a sum (Partial): DTensor reduces it in the step, so the whole step
        # goes through DTensor and equals torch's.
        ours, theirs = parameters(mesh, 1), parameters(mesh, 1)
        ours_opt, theirs_opt = OPTIMIZERS["AdamW"](ours[:-1], lr=0.1), torch.optim.AdamW(theirs[:-1], lr=0.1)
        for params in (ours, theirs):
            set_gradients(params, mesh, 0)
            replicated = params[2]
            replicated.grad = DTensor.from_local(torch.full((7,), float(rank + 1)), mesh, [Partial()])
        with DTensorOps() as seen:
            ours_opt.step()
        theirs_opt.step()
        assert seen.ops  # through DTensor
        for a, b in zip(ours, theirs):
            assert torch.equal(local(a), local(b))

        # Gradient clipping's factor on the local shards, as torch's clip_grads_with_norm_.
        ours, theirs = parameters(mesh, 2), parameters(mesh, 2)
        set_gradients(ours, mesh, 0)
        set_gradients(theirs, mesh, 0)
        norm = torch.tensor(7.5, dtype=torch.float64)
        scale_gradients_([p.grad for p in ours[:-1]], torch.clamp(1.0 / (norm.float() + 1e-6), max=1.0))
        torch.nn.utils.clip_grads_with_norm_(theirs[:-1], 1.0, norm.float(), foreach=True)
        for a, b in zip(ours, theirs):
            assert torch.equal(local(a.grad), local(b.grad))
    finally:
        dist.destroy_process_group()


def test_local_shard_steps_equal_torchs_through_dtensor(tmp_path):
    start_ranks(compare_optimizers, (str(tmp_path / "store"),), 2)


def test_a_first_step_state_is_made_a_dtensor_of_the_parameters_layout(one_rank_mesh):
    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 2), one_rank_mesh, [Shard(0)]))
    optimizer = OPTIMIZERS["AdamW"]([param], lr=0.1)
    param.grad = distribute_tensor(torch.ones(4, 2), one_rank_mesh, [Shard(0)])
    optimizer.step()
    state = optimizer.state[param]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == (Shard(0),)
    assert not isinstance(state["step"], DTensor) and state["step"].item() == 1.0
    assert param._local_tensor.grad is None and param.grad is not None  # the parameter keeps its gradient


def test_a_step_with_a_closure_uses_the_gradients_the_closure_computes(one_rank_mesh):
    """A closure recomputes the gradients inside the step, after shards would have taken theirs:
    such a step goes through DTensor, and equals torch's."""
    results = []
    for optimizer_class in (OPTIMIZERS["AdamW"], torch.optim.AdamW):
        param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), one_rank_mesh, [Shard(0)]))
        optimizer = optimizer_class([param], lr=0.1)
        param.grad = distribute_tensor(torch.full((4, 2), -1.0), one_rank_mesh, [Shard(0)])  # stale

        def closure():
            param.grad = distribute_tensor(torch.arange(8.0).view(4, 2), one_rank_mesh, [Shard(0)])
            return torch.tensor(0.0)

        optimizer.step(closure)
        results.append(param.to_local().detach().clone())
    assert torch.equal(results[0], results[1])
