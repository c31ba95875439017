"""The [validation] section: held-out evaluation during training.

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainer.config.dataloader import DataLoader
from trainer.config.ranges import valid

# validation.steps = WHOLE_SPLIT: every sequence of the validation split, once.
WHOLE_SPLIT = -1


@dataclass
class Validation:
    """Held-out evaluation during training."""

    enable: bool = False
    """Compute validation loss every `freq` steps."""

    dataset: str = ""
    """Validation data source, named as training.dataset. Empty: the held-out split of
    training.dataset (synthetic: other walks of the same chain; files, shards and python_stdlib:
    the documents of training.validation_fraction, which training never reads; Hugging Face: the
    'validation' split)."""

    dataset_path: str = ""
    """Local path for the validation source (as training.dataset_path)."""

    global_batch_size: int = valid(64, ge=1)
    """Sequences per validation batch over all ranks: the same rows, and so the same loss, in
    every parallel layout. Each data-parallel rank evaluates its share (the last ranks' shares
    padded with sequences that count for nothing when it does not divide evenly)."""

    local_batch_size: Optional[int] = valid(None, ge=1)
    """Sequences per forward pass of a data-parallel rank in validation (a memory bound, not a
    batch definition). Unset: training.local_batch_size."""

    seq_len: Optional[int] = valid(None, ge=1)
    """Tokens per validation sequence. Unset: training.seq_len."""

    freq: int = valid(500, ge=1)
    """Validate every this many training steps."""

    steps: int = valid(10, ge=1, note="batches per evaluation",
                       also=((WHOLE_SPLIT, "the whole validation split"),))
    """Validation batches per evaluation (the same batches every time). -1: the whole validation
    split, every sequence once (the tail of the split shorter than one sequence is not read), in
    batches of global_batch_size whose last one is padded with sequences that count for nothing;
    the same loss in every parallel layout. -1 needs a split of known length, 'files', 'c4_test',
    'shards' or 'python_stdlib' (training.dataset's held-out split, or validation.dataset); it is refused for
    'synthetic' (endless), a streamed Hugging Face dataset (its length is unknown until read) and
    a [[training.datasets]] mixture (drawn by weight, so it has no single pass)."""

    dataloader: DataLoader = field(default_factory=DataLoader)
    """[validation.dataloader]: worker processes reading the coming validation batches ahead."""
