"""Memory of one rank over a training step, by kind, from torch's MemTracker.

MemTracker (torch.distributed._tools.mem_tracker) sees every tensor the step creates (a dispatch
mode) and every storage resize (FSDP frees and re-allocates unsharded parameters that way), and
files each under parameters, buffers, gradients, activations (forward), temporaries (backward)
or optimizer state. Two changes for a training step: a module may run several times per step
(pipeline and accumulation microbatches), which MemTracker's per-module statistics refuse, and
only the global peak is needed, which is kept without walking every module at every operation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import _pop_mode, _push_mode

TOTAL = "Total"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held at the peak, by kind. `parameters` includes FSDP's unsharded (all-gathered)
    copies that are alive at that moment; `temporaries` are what backward allocates besides
    gradients (gradients of activations, recomputed activations under AC, communication buffers)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries, "total": self.total}


def opened_ops() -> dict:
    """Custom ops whose own allocations count: the tracker runs their bodies as plain code, where
    it would otherwise see only their outputs (ring attention's chunk pairs, buffers and hops)."""
    import torch

    from trainer.parallel import ring_attention

    ops = torch.ops.trainer
    return {ops.ring_attention.default: ring_attention.ring_attention_body,
            ops.ring_attention_backward.default: ring_attention.ring_attention_backward_body}


class StepMemory(MemTracker):
    """`with StepMemory() as memory: ...`, after `memory.track_external(model, optimizer)` for what
    exists before; then `memory.peak()`."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = opened_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self._opened.get(func)
        if body is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # A mode is off the stack while it handles an op: put it back, so that the body's ops are tracked.
        _push_mode(self)
        try:
            return body(*args, **(kwargs or {}))
        finally:
            _pop_mode()

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]  # the next microbatch through this module
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[TOTAL]:
                self._peak_mem[device] = snapshot[TOTAL]
                self._peak_mem_snap[device] = dict(snapshot)

    def peak(self) -> MemoryBreakdown:
        """The moment of the highest total, summed over devices (one per rank)."""
        totals: dict[str, int] = {}
        for snapshot in self.get_tracker_snapshot("peak").values():
            for kind, size in snapshot.items():
                name = getattr(kind, "value", kind)  # "Parameter", "Gradient", ... and "Total"
                totals[name] = totals.get(name, 0) + size
        return MemoryBreakdown(
            parameters=totals.get("Parameter", 0) + totals.get("Buffer", 0),
            gradients=totals.get("Gradient", 0),
            optimizer=totals.get("Optstate", 0),
            activations=totals.get("Activation", 0),
            temporaries=totals.get("Temp", 0) + totals.get("Other", 0),
        )
