"""Elementwise updates of sharded parameters and gradients, run on each rank's local shards.

Adam's and AdamW's step, and the multiplications of gradient clipping (by its factor, once the
global norm is known) and of loss unscaling, treat every element on its own: on a DTensor they run
the same operation on each rank's local shard. Run through DTensor, each of
those foreach operations first has its sharding worked out, once per process for every distinct
list of parameter layouts, and looked up over every parameter at every later step: on 2 ranks of
the tiny model, 0.18 CPU-seconds at the first step under FSDP and 0.34 under TP, against 0.006 on
the local shards (benchmarks/optimizer_update.py). Run on the local tensors, the same kernels
see the same tensors in the same order, so the numbers are bitwise those of the DTensor path
(tests/unit/test_local_shards.py compares the two).

That holds only when a gradient and the optimizer state have exactly their parameter's layout:
a gradient left Partial (a sum still owed) would have to be reduced first, which DTensor does and
a local step would not. Where any DTensor parameter's gradient or state has another layout, the
whole step runs through DTensor, as before. The multiplications need no such check: scaling each
part of a partial sum scales the sum.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


def same_layout(tensor, param: DTensor) -> bool:
    return (isinstance(tensor, DTensor) and tensor.device_mesh == param.device_mesh
            and tensor.placements == param.placements)


def shard_views(optimizer: torch.optim.Optimizer) -> dict | None:
    """DTensor parameter -> its local shard, or None when some DTensor parameter's gradient or
    state (every tensor of it with the parameter's elements) has another layout."""
    views = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = [v for v in optimizer.state.get(param, {}).values() if torch.is_tensor(v) and v.dim() > 0]
            if param.grad is not None and not same_layout(param.grad, param):
                return None
            if not all(same_layout(v, param) for v in state):
                return None
            views[param] = param._local_tensor
    return views


def as_parameter_layout(value, param: DTensor, shard: torch.Tensor):
    """A state value the step created on the shard: a tensor of the shard's shape becomes a
    DTensor with its parameter's layout (as zeros_like on the DTensor would have made it); a step
    count stays as it is."""
    if torch.is_tensor(value) and not isinstance(value, DTensor) and value.dim() > 0 and value.shape == shard.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


class StepOnLocalShards:
    """Mixin for a torch optimizer whose step is elementwise (Adam, AdamW): `step` runs on the
    local shards of DTensor parameters (module docstring), with their gradients' and state's
    local shards; state the step creates (the first step) is kept as DTensors, so checkpoints
    see the same optimizer state either way. A step given a closure goes through DTensor."""

    @torch.no_grad()
    def step(self, closure=None):
        # A closure recomputes the gradients inside torch's step, after the shards took theirs.
        views = shard_views(self) if closure is None else None
        if not views:
            return super().step(closure)
        saved_state, saved_params = self.state, [group["params"] for group in self.param_groups]
        self.state = self._state_on_shards(views)
        for group in self.param_groups:
            group["params"] = [views.get(param, param) for param in group["params"]]
        for param, shard in views.items():
            shard.grad = None if param.grad is None else param.grad.to_local()
        try:
            return super().step(closure)
        finally:
            local_state, self.state = self.state, saved_state
            for group, params in zip(self.param_groups, saved_params):
                group["params"] = params
            self._keep_state(local_state, views)

    def _state_on_shards(self, views: dict) -> defaultdict:
        """The optimizer's state keyed by what the step will see: a sharded parameter's shard, with
        its state's shards; a plain parameter's own state dict, so what the step changes stays."""
        state_on_shards = defaultdict(dict)
        for param, state in self.state.items():
            shard = views.get(param)
            if shard is None:
                state_on_shards[param] = state
            else:
                state_on_shards[shard] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
        return state_on_shards

    def _keep_state(self, local_state: dict, views: dict) -> None:
        """After a step on the shards: the shards let go of their gradients, and what the step
        wrote into the state (new state, a step count it replaced) goes back to each parameter's."""
        for param, shard in views.items():
            shard.grad = None
            kept = self.state[param]
            for name, value in local_state.pop(shard, {}).items():
                before = kept.get(name)
                if not (isinstance(before, DTensor) and before._local_tensor is value):
                    kept[name] = as_parameter_layout(value, param, shard)
        self.state.update(local_state)  # plain parameters: their state dicts, new or the same


def scale_gradients_(grads, factor) -> None:
    """Multiply every gradient by `factor` (a Python number, or a 0-dim tensor as gradient
    clipping's), in place, on the local shards: one foreach kernel per device and dtype."""
    groups = defaultdict(list)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        groups[(local.device, local.dtype)].append(local)
    for (device, _), tensors in groups.items():
        torch._foreach_mul_(tensors, factor.to(device) if torch.is_tensor(factor) else factor)
