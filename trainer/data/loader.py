"""Layout-invariant batches for one data-parallel rank.

Global batch s is rows [s*G, (s+1)*G) of the source's row stream (G = global batch size). DP rank
r takes the contiguous block [r*G/dp, (r+1)*G/dp) and splits it into microbatches of the local
batch size (gradient accumulation). Tensor-, pipeline- and context-parallel ranks of the same DP
rank get the same rows. The loader's state is the global step, so it resumes under any layout.
"""

from __future__ import annotations

import torch


class BatchLoader:
    def __init__(self, source, *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, device: torch.device):
        rows_per_rank, rest = divmod(global_batch_size, dp_degree)
        if rest or rows_per_rank % local_batch_size:
            raise ValueError(
                f"global batch {global_batch_size} does not split into {dp_degree} data-parallel ranks "
                f"x whole local batches of {local_batch_size}"
            )
        self.source = source
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.rows_per_rank = rows_per_rank
        self.dp_rank = dp_rank
        self.device = device
        self.step = 0  # global batches consumed

    @property
    def accumulation_steps(self) -> int:
        return self.rows_per_rank // self.local_batch_size

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches (inputs, labels) of the next global batch."""
        first = self.step * self.global_batch_size + self.dp_rank * self.rows_per_rank
        tokens = torch.from_numpy(self.source.rows(first, self.rows_per_rank, self.seq_len + 1))
        self.step += 1
        micro = tokens.split(self.local_batch_size)
        return [(m[:, :-1].to(self.device), m[:, 1:].to(self.device)) for m in micro]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
