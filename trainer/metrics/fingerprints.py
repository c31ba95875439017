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
    attention_rms the root mean square of the attention branch's output (what the attention adds
                  to the residual stream, after `wo`, before the residual add)
    ffn_rms       the same of the feed-forward branch (after `w2`)
so a forward bug inside a block shows in the first of its two branches that it reaches, with
every block before it unchanged.

Every figure is a global one computed without gathering a tensor: each rank adds the squares of
its own elements in float64 (a parameter's shard counts once, its replicated copies do not, as in
the global gradient norm: trainer.optim.counted_part; a block's output and branches are split
over the sequence, the batch and the pipeline, so every rank's elements are distinct; under TP
with sequence parallelism the branches leave `wo` and `w2` reduce-scattered over the sequence; a
DTensor of partial sums would be summed over its mesh first, which no layout here needs), and one
all-reduce of all the sums over every rank gives the same numbers in every layout.
Gradient accumulation and pipeline microbatches add up over the step. The blocks hand their
branches to the probe as extra outputs, only at a recorded step: a compiled block has one graph
for those steps and its usual one for the others, and activation checkpointing's recomputation
in backward, whose outputs go nowhere, adds nothing.

Reduced-sync TP (trainer/parallel/reduced_sync.py): blocks inside a group hand on a partial
stream, so they have no output or gradient RMS (null); the blocks that end a group have them.
No block has branch figures there (null): each rank's attention and FFN outputs are its partial
sums, whose sum is never formed (forming it would add the collectives the mode removes).

The logging rank appends one JSON line per recorded step to <dump_folder>/fingerprints.jsonl:
    {"step": 3, "skipped": false,
     "grad_norm": {"layers.0.attention.wq.weight": 0.0123, ...}, "update_norm": {...},
     "param_norm": {...}, "output_rms": {"0": 1.02, ...}, "grad_rms": {"0": 3.1e-05, ...},
     "attention_rms": {"0": 0.011, ...}, "ffn_rms": {"0": 0.009, ...}}
A value that is not finite (an overflowed float16 step) is written as null. Files written before
the branch figures existed lack attention_rms and ffn_rms; they read as before.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from trainer.optim import NormReduction, counted_part
from trainer.records.run_meta import BLOCK_QUANTITIES, BRANCH_QUANTITIES, FINGERPRINTS_FILE, PARAMETER_QUANTITIES
from trainer.records.safe_writes import append_text


def is_recorded(step: int, first: int, every: int) -> bool:
    """Steps 1..first, then every `every`-th step (0: none after the first ones)."""
    return step <= first or (every > 0 and step % every == 0)


class BlockProbe:
    """Adds up, while active, the squares and element counts of each block's output (forward), of
    the gradient reaching that output (backward), and of the block's attention and feed-forward
    branches (forward), over every microbatch of a step. Attached with Transformer.attach_probe on
    every pipeline stage of this rank."""

    # The columns of `sums`, per block: a sum of squares and its element count for each quantity.
    OUTPUT, GRAD, ATTENTION, FFN = 0, 2, 4, 6
    COLUMNS = 8

    def __init__(self, block_names: list[str], device: torch.device):
        self.row = {name: i for i, name in enumerate(block_names)}
        self.sums = torch.zeros(len(block_names), self.COLUMNS, dtype=torch.float64, device=device)
        self.active = False

    @property
    def recording(self) -> bool:
        """Whether this forward pass counts: not when inactive, nor in an evaluation pass. The
        model asks the blocks for their branches only then."""
        return self.active and torch.is_grad_enabled()

    def __call__(self, name: str, output, attention: torch.Tensor | None = None,
                 ffn: torch.Tensor | None = None) -> None:
        """A block's output (a pair, not a tensor, inside a reduced-sync group: a partial stream,
        not counted) and, at a recorded step, its two branches (None under reduced sync)."""
        if not self.recording:
            return
        row = self.row[name]
        self._add(row, self.ATTENTION, attention)
        self._add(row, self.FFN, ffn)
        if isinstance(output, torch.Tensor) and self._add(row, self.OUTPUT, output) and output.requires_grad:
            output.register_hook(partial(self._add_gradient, row))

    def _add_gradient(self, row: int, grad: torch.Tensor) -> None:
        self._add(row, self.GRAD, grad)  # returns None: the hook leaves the gradient as it is

    def _add(self, row: int, column: int, tensor: torch.Tensor | None) -> bool:
        """Add this rank's part of `tensor` to `sums`; False when this rank counts nothing of it."""
        local = self._counted(tensor) if tensor is not None else None
        if local is None:
            return False
        self.sums[row, column] += local.detach().double().square().sum()
        self.sums[row, column + 1] += local.numel()
        return True

    @staticmethod
    def _counted(tensor: torch.Tensor) -> torch.Tensor | None:
        """The elements this rank counts: all of a plain tensor (split over sequence, batch or
        pipeline); a DTensor's shard unless it is another rank's replica. A DTensor of partial
        sums (a row-parallel projection left unreduced) is summed first: the squares of the
        parts do not add up to the square of their sum."""
        if not hasattr(tensor, "to_local"):
            return tensor
        if any(p.is_partial() for p in tensor.placements):
            tensor = tensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in tensor.placements])
        return counted_part(tensor, tensor.device_mesh.size())


class FingerprintRecorder:
    """Records the fingerprints of the steps metrics.fingerprint_first / fingerprint_every
    choose. The trainer calls, at such a step: `start` before forward, `gradients` after
    backward (before unscaling and clipping), `finish` after the optimizer step."""

    def __init__(self, model, stages, reduce: NormReduction, all_names: list[str], n_layers: int,
                 first: int, every: int, folder: Path | None, device: torch.device):
        """`model`: every parameter of this rank under its original name; `stages`: the
        Transformers that run (the probe is attached to them); `all_names`: every parameter name of
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
            stage.attach_probe(self.probe)
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
            self.probe.sums[:, BlockProbe.GRAD] /= loss_scale ** 2
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
        blocks = totals[3 * n:].view(len(self.blocks), BlockProbe.COLUMNS).tolist()
        line = {"step": step, "skipped": skipped}
        for column, quantity in enumerate(PARAMETER_QUANTITIES):
            line[quantity] = {name: finite(math.sqrt(row[column])) for name, row in zip(self.names, params)}
        columns = (BlockProbe.OUTPUT, BlockProbe.GRAD, BlockProbe.ATTENTION, BlockProbe.FFN)
        for column, quantity in zip(columns, BLOCK_QUANTITIES + BRANCH_QUANTITIES):
            line[quantity] = {name: rms(row[column], row[column + 1]) for name, row in zip(self.blocks, blocks)}
        append_text(self.path, json.dumps(line) + "\n")  # never through a link (trainer/records/safe_writes.py)


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
