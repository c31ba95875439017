"""Layout-invariant batches for one data-parallel rank.

Global batch s is rows [s*G, (s+1)*G) of the source's row stream (G = global batch size). DP rank
r takes the contiguous block [r*G/dp, (r+1)*G/dp) and splits it into microbatches of the local
batch size (gradient accumulation). Tensor-, pipeline- and context-parallel ranks of the same DP
rank get the same rows. The loader's state is the global step (plus, for streamed sources, the
stream position, which is the same on every rank), so it resumes under any layout.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class BatchLoader:
    def __init__(self, source, *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, device: torch.device, name: str = "training"):
        rows_per_rank, rest = divmod(global_batch_size, dp_degree)
        if rest or rows_per_rank % local_batch_size:
            raise ValueError(
                f"global batch {global_batch_size} does not split into {dp_degree} data-parallel ranks "
                f"x whole local batches of {local_batch_size}"
            )
        self.source = source
        self.row_length = seq_len + 1  # inputs and labels are the row shifted by one token
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.rows_per_rank = rows_per_rank
        self.dp_rank = dp_rank
        self.device = device
        self.name = name
        self.step = 0  # global batches consumed
        self.epoch = 0
        self._initial_source_state = self._source_state()

    @property
    def accumulation_steps(self) -> int:
        return self.rows_per_rank // self.local_batch_size

    def _rank_rows(self):
        first = self.step * self.global_batch_size
        if self.source.random_access:
            # Decided on the whole global batch, so every rank stops at the same step (a rank
            # whose own rows still exist must not train on while its peers have stopped).
            self.source.check_available(first + self.global_batch_size - 1, self.row_length)
            return self.source.rows(first + self.dp_rank * self.rows_per_rank, self.rows_per_rank, self.row_length)
        # A stream is read whole on every rank so its position stays rank-independent.
        rows = self.source.rows(first, self.global_batch_size, self.row_length)
        return rows[self.dp_rank * self.rows_per_rank:(self.dp_rank + 1) * self.rows_per_rank]

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches (inputs, labels) of the next global batch.
        Raises DataExhausted when a finite source ends and is configured to stop."""
        tokens = torch.from_numpy(self._rank_rows())
        epoch = self.source.epoch_of((self.step + 1) * self.global_batch_size - 1, self.row_length)
        if epoch != self.epoch:
            logger.info("%s data: epoch %d begins at global batch %d", self.name, epoch, self.step + 1)
            self.epoch = epoch
        self.step += 1
        if self.device.type == "cuda":
            # One asynchronous copy from page-locked memory: the host does not wait for the device.
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
        else:
            tokens = tokens.to(self.device)
        micro = tokens.split(self.local_batch_size)
        return [(m[:, :-1], m[:, 1:]) for m in micro]

    def _source_state(self) -> dict | None:
        return None if self.source.random_access else self.source.state_dict()

    def state_dict(self) -> dict:
        state = {"step": self.step, "epoch": self.epoch}
        if not self.source.random_access:
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch = int(state["step"]), int(state.get("epoch", 0))
        if not self.source.random_access:
            self.source.load_state_dict(state["source"])

    def reset(self) -> None:
        """Back to the first batch (validation reads the same batches at every evaluation)."""
        self.step, self.epoch = 0, 0
        if not self.source.random_access:
            self.source.load_state_dict(self._initial_source_state)


def check_evaluation_fits(loader: BatchLoader, steps: int) -> None:
    """An evaluation reads `steps` global batches from the start of the validation split: refuse
    a split without one whole sequence, and warn when an evaluation would read some twice."""
    if not hasattr(loader.source, "rows_per_epoch"):  # endless, or a stream of unknown length
        return
    available = loader.source.rows_per_epoch(loader.row_length)
    loader.source.check_available(0, loader.row_length)  # DataError when it holds no whole sequence
    needed = steps * loader.global_batch_size
    if needed > available:
        logger.warning("%s data: one evaluation reads %d sequences of %d tokens but the split holds %d, so some are "
                       "read twice; lower validation.steps or validation.local_batch_size, or add validation data",
                       loader.name, needed, loader.row_length - 1, available)
