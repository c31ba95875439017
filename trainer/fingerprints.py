"""Per-module fingerprints of chosen training steps (metrics.fingerprints): what lets a comparison
of two layouts say *where* they part, not only that they do.

At a recorded step, for every parameter under its original name (the unsharded model's, the same
in every layout):
    grad_norm     the L2 norm of its gradient before clipping (unscaled under float16 loss scaling)
    update_norm   the L2 norm of what the optimizer step changed (0 on a skipped float16 step)
    param_norm    the L2 norm of its value after the step
and for every transformer block, over all the tokens of the global batch:
    output_rms    the root mean square of the block's output (the residual stream it hands on)
    grad_rms      the root mean square of the loss gradient with respect to that output (what
                  flows into the block in backward)

Every figure is a global one computed without gathering a tensor: each rank adds the squares of
its own elements in float64 (a parameter's shard counts once, its replicated copies do not, as in
the global gradient norm: trainer.optim.counted_part; a block's output is split over the
sequence, the batch and the pipeline, so every rank's elements are distinct), and one all-reduce
of all the sums over every rank gives the same numbers in every layout. Blocks inside a group of
reduced-sync TP hand on a partial stream (trainer/parallel/reduced_sync.py): they have none.

The logging rank appends one JSON line per recorded step to <dump_folder>/fingerprints.jsonl:
    {"step": 3, "skipped": false,
     "grad_norm": {"layers.0.attention.wq.weight": 0.0123, ...}, "update_norm": {...},
     "param_norm": {...}, "output_rms": {"0": 1.02, ...}, "grad_rms": {"0": 3.1e-05, ...}}
A value that is not finite (an overflowed float16 step) is written as null.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.optim import NormReduction, counted_part
from trainer.run_record import FINGERPRINTS_FILE, PARAMETER_QUANTITIES
from trainer.safe_writes import append_text


def is_recorded(step: int, first: int, every: int) -> bool:
    """Steps 1..first, then every `every`-th step (0: none after the first ones)."""
    return step <= first or (every > 0 and step % every == 0)


class BlockProbe:
    """Adds up, while active, the squares and element counts of each block's output (forward) and
    of the gradient reaching that output (backward), over every microbatch of a step. Installed
    as Transformer.block_probe on every pipeline stage of this rank."""

    def __init__(self, block_names: list[str], device: torch.device):
        self.row = {name: i for i, name in enumerate(block_names)}
        # Per block: output sum of squares, output elements, gradient sum of squares, gradient elements.
        self.sums = torch.zeros(len(block_names), 4, dtype=torch.float64, device=device)
        self.active = False

    def __call__(self, name: str, output) -> None:
        if not self.active or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
            return  # inactive, an evaluation pass, or a partial stream inside a reduced-sync group
        local = self._counted(output)
        if local is None:
            return
        row = self.row[name]
        self.sums[row, 0] += local.detach().double().square().sum()
        self.sums[row, 1] += local.numel()
        if output.requires_grad:
            output.register_hook(partial(self._add_gradient, row))

    def _add_gradient(self, row: int, grad: torch.Tensor) -> None:
        local = self._counted(grad)
        if local is not None:
            self.sums[row, 2] += local.detach().double().square().sum()
            self.sums[row, 3] += local.numel()

    @staticmethod
    def _counted(tensor: torch.Tensor) -> torch.Tensor | None:
        """The elements this rank counts: all of a plain tensor (split over sequence, batch or
        pipeline); a DTensor's shard unless it is another rank's replica."""
        if hasattr(tensor, "to_local"):
            return counted_part(tensor, tensor.device_mesh.size())
        return tensor


class FingerprintRecorder:
    """Records the fingerprints of the steps metrics.fingerprint_first / fingerprint_every
    choose. The trainer calls, at such a step: `start` before forward, `gradients` after
    backward (before unscaling and clipping), `finish` after the optimizer step."""

    def __init__(self, model, stages, reduce: NormReduction, all_names: list[str], n_layers: int,
                 first: int, every: int, folder: Path | None, device: torch.device):
        """`model`: every parameter of this rank under its original name; `stages`: the
        Transformers that run (their block_probe is set); `all_names`: every parameter name of
        the whole model, the same list on every rank; `folder`: where the logging rank writes
        (None on the other ranks)."""
        self.parameters = [(name, p) for name, p in model.named_parameters()
                           if not any(p is d for d in reduce.duplicates)]
        self.reduce = reduce
        self.names = list(all_names)
        self.row = {name: i for i, name in enumerate(self.names)}
        self.blocks = [str(i) for i in range(n_layers)]
        self.probe = BlockProbe(self.blocks, device)
        for stage in stages:
            stage.block_probe = self.probe
        self.first, self.every = first, every
        self.path = Path(folder) / FINGERPRINTS_FILE if folder is not None else None
        self.device = device
        self._sums = None  # per parameter: gradient, update, value sums of squares
        self._rows = None  # the rows of _sums this rank fills, one per counted parameter
        self._counted: list[torch.nn.Parameter] = []  # the parameters this rank counts, in _rows order
        self._before: list[torch.Tensor] = []  # their parts before the optimizer step

    def records(self, step: int) -> bool:
        return is_recorded(step, self.first, self.every)

    def start(self) -> None:
        self.probe.sums.zero_()
        self.probe.active = True
        self._sums = torch.zeros(len(self.names), 3, dtype=torch.float64, device=self.device)

    def gradients(self, loss_scale: float | None) -> None:
        """Sum the squares of the gradients (divided by the float16 loss scale they carry), and
        keep this rank's part of each parameter to measure the update by."""
        self.probe.active = False
        if loss_scale is not None:  # the probe's gradients carry the scale too
            self.probe.sums[:, 2] /= loss_scale ** 2
        rows, grads, self._counted, self._before = [], [], [], []
        for name, p in self.parameters:
            value = counted_part(p, self.reduce.ranks_per_stage)
            if value is None:
                continue
            rows.append(self.row[name])
            self._counted.append(p)
            self._before.append(value.detach().clone())
            grad = counted_part(p.grad, self.reduce.ranks_per_stage) if p.grad is not None else None
            grads.append(grad if grad is not None else torch.zeros_like(value))
        self._rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        if rows:
            scale_squared = loss_scale ** 2 if loss_scale is not None else 1.0
            self._sums[self._rows, 0] = squared_norms(grads).to(self.device) / scale_squared

    @torch.no_grad()
    def finish(self, step: int, skipped: bool) -> None:
        """After the optimizer step: sum the squares of each update and value, add every rank's
        sums up, and write the step's line."""
        if self._counted:
            after = [counted_part(p, self.reduce.ranks_per_stage).detach() for p in self._counted]
            # .to(device): parameters offloaded to the CPU (training.enable_cpu_offload) sum there
            self._sums[self._rows, 1] = squared_norms(torch._foreach_sub(after, self._before)).to(self.device)
            self._sums[self._rows, 2] = squared_norms(after).to(self.device)
        self._counted, self._before = [], []
        totals = torch.cat([self._sums.flatten(), self.probe.sums.flatten()])
        if self.reduce.group is not None:
            dist.all_reduce(totals, group=self.reduce.group)
        if self.path is not None:
            self._write(step, skipped, totals.cpu())

    def _write(self, step: int, skipped: bool, totals: torch.Tensor) -> None:
        n = len(self.names)
        params = totals[: 3 * n].view(n, 3).tolist()
        blocks = totals[3 * n:].view(len(self.blocks), 4).tolist()
        line = {"step": step, "skipped": skipped}
        for column, quantity in enumerate(PARAMETER_QUANTITIES):
            line[quantity] = {name: finite(math.sqrt(row[column])) for name, row in zip(self.names, params)}
        line["output_rms"] = {name: rms(row[0], row[1]) for name, row in zip(self.blocks, blocks)}
        line["grad_rms"] = {name: rms(row[2], row[3]) for name, row in zip(self.blocks, blocks)}
        append_text(self.path, json.dumps(line) + "\n")  # never through a link (trainer/safe_writes.py)


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square()


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rms(squares: float, count: float) -> float | None:
    """None where nothing was counted (a block inside a reduced-sync group) or not finite."""
    return finite(math.sqrt(squares / count)) if count > 0 else None


def parameter_names(model_args) -> list[str]:
    """Every parameter name of the whole model (one name for a tied weight), built on the meta
    device: the same list on every rank, whichever stage it holds."""
    from trainer.models.llama3.model import Transformer

    with torch.device("meta"):
        return [name for name, _ in Transformer(model_args).named_parameters()]
