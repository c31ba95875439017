"""Count the collectives a piece of code issues, by op and dtype (blocking c10d calls and
functional collectives alike, and CP's ring attention ops, whose point-to-point hops run inside
them): `with CountCollectives() as log: ...; log.counts`."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()  # (op name, dtype name) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ring = func.namespace == "trainer" and func.__name__.startswith("ring_attention")
        if ring or func.namespace in ("c10d", "_c10d_functional") and func.__name__.split(".")[0] != "wait_tensor":
            tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            self.counts[(func.__name__.split(".")[0], str(tensors[0].dtype).removeprefix("torch."))] += 1
        return func(*args, **(kwargs or {}))

    def by_op(self) -> dict[str, int]:
        ops: Counter = Counter()
        for (op, _), n in self.counts.items():
            ops[op] += n
        return dict(ops)
