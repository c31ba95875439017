"""Counting the collectives one training step issues, by mesh dimension, pass and operation.

What a parallel layout costs in communication is decided by the code paths it takes, so it is
measured, not derived: `metrics.count_collectives` runs the first step of a start under
`CollectiveCounter`, a dispatch mode that sees every collective call (DTensor's functional
collectives and torch.distributed's blocking ones alike) before it runs. Each is attributed to
the mesh dimension of its process group (`tp`, `dp_shard`, ... ; `other` for the default group,
e.g. the loss and gradient-norm reductions) and to the part of the step it ran in: `data`
(reading the batch), `forward`, `backward` (whatever the autograd engine issued, gradient hooks
included) and `update` (gradient norm, clipping, optimizer step).

Under sequence parallelism a tensor-parallel synchronization point is a reduce-scatter (leaving
a block's attention or feed-forward) paired with an all-gather (entering the next one); without
it, one all-reduce. `tp_syncs_per_forward` counts them: the reduce-scatters plus all-reduces of
the `tp` group in the forward pass.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")
# CP's ring attention (trainer/parallel/ring_attention.py): its point-to-point hops run inside one
# custom op each way, counted as one call of the `cp` group with the bytes its hops send.
RING_OPS = ("ring_attention", "ring_attention_backward")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping ops of those namespaces
SYNC_OPS = ("reduce_scatter_tensor", "all_reduce", "reduce_scatter_", "allreduce_", "_reduce_scatter_base_")


def mesh_group_names(meshes) -> dict[str, str]:
    """Process-group name -> mesh dimension, for the named and flattened dimensions of size > 1."""
    names = {}
    for dim in [*meshes.world.mesh_dim_names, *meshes.flattened]:
        mesh = meshes[dim]
        if mesh.size() > 1:
            names.setdefault(mesh.get_group().group_name, dim)
    return names


def buffer_bytes(args, kwargs, result) -> int:
    """The size of a collective's largest tensor, argument or result: the gathered output of an
    all-gather (an argument of c10d's, the result of the functional one DTensor calls), the input
    of a reduce-scatter, the buffer of an all-reduce or a point-to-point transfer. (A ring
    algorithm sends and receives (n-1)/n of it per rank.)"""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs, result))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


def _group_name(value) -> str | None:
    if isinstance(value, str):
        return value
    try:  # a ProcessGroup passed to a c10d op arrives boxed
        return torch.distributed.ProcessGroup.unbox(value).group_name
    except (AttributeError, RuntimeError, TypeError):
        return None


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter(group_names) as counter: ...`; then `counter.summary()`."""

    def __init__(self, group_names: dict[str, str]):
        super().__init__()
        self.group_names = group_names
        self.phase = "data"  # set by the training step as it goes on: data, forward, update
        self.counts: Counter = Counter()  # (dimension, part of the step, op) -> calls
        self.bytes: Counter = Counter()  # (dimension, part of the step, op) -> buffer bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.__name__.split(".")[0]
        result = func(*args, **(kwargs or {}))
        ring = func.namespace == "trainer" and op in RING_OPS
        if ring or (func.namespace in NAMESPACES and op not in NOT_COLLECTIVES):
            key = (self._dimension(args, kwargs), self._pass(), op)
            self.counts[key] += 1
            if ring:
                from trainer.parallel.ring_attention import ring_bytes

                self.bytes[key] += ring_bytes(op, args)
            else:
                self.bytes[key] += buffer_bytes(args, kwargs, result)
        return result

    def _dimension(self, args, kwargs) -> str:
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            name = _group_name(value) if not isinstance(value, torch.Tensor) else None
            if name in self.group_names:
                return self.group_names[name]
        return "other"

    def _pass(self) -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else self.phase

    def summary(self, forward_passes: int) -> dict:
        """{dimension: {pass: {op: calls}}} over the step, and the tensor-parallel syncs of one
        forward pass (the step ran `forward_passes` microbatches through this rank's model)."""
        table: dict = {}
        for (dimension, phase, op), calls in sorted(self.counts.items()):
            table.setdefault(dimension, {}).setdefault(phase, {})[op] = calls
        forward_tp = table.get("tp", {}).get("forward", {})
        syncs = sum(forward_tp.get(op, 0) for op in SYNC_OPS)
        bytes_table = {dimension: {op: figures["bytes"] for op, figures in ops.items()}
                       for dimension, ops in self.per_op().items()}
        return {"by_dimension": table, "bytes_by_dimension": bytes_table, "forward_passes": forward_passes,
                "tp_syncs_per_forward": syncs / forward_passes}

    def per_op(self) -> dict:
        """{dimension: {op: {"calls", "bytes"}}} over the whole step, all its parts together."""
        table: dict = {}
        for (dimension, phase, op), calls in sorted(self.counts.items()):
            entry = table.setdefault(dimension, {}).setdefault(op, {"calls": 0, "bytes": 0})
            entry["calls"] += calls
            entry["bytes"] += self.bytes[(dimension, phase, op)]
        return table

    @staticmethod
    def totals(summary: dict) -> dict[str, int]:
        """Calls per dimension and pass ("tp_forward": 26, ...) and the syncs per forward, for metrics."""
        totals = {f"{dimension}_{phase}": sum(ops.values())
                  for dimension, passes in summary["by_dimension"].items() for phase, ops in passes.items()}
        return {**totals, "tp_syncs_per_forward": summary["tp_syncs_per_forward"]}


def describe(summary: dict) -> str:
    """One line: `tp forward 26 (all_gather_into_tensor 13, reduce_scatter_tensor 13), ...`."""
    parts = []
    for dimension, passes in summary["by_dimension"].items():
        for phase, ops in passes.items():
            inner = ", ".join(f"{op} {calls}" for op, calls in ops.items())
            parts.append(f"{dimension} {phase} {sum(ops.values())} ({inner})")
    return "; ".join(parts) + f"; tensor-parallel syncs per forward pass: {summary['tp_syncs_per_forward']:g}"
