"""Layout-invariant batches for one data-parallel rank.

The next global batch is rows [c, c+G) of the source's row stream, c being the rows consumed so
far and G the global batch size. DP rank r takes the contiguous block [c + r*G/dp, c + (r+1)*G/dp)
and splits it into microbatches of the local batch size (gradient accumulation). Tensor-,
pipeline- and context-parallel ranks of the same DP rank get the same rows.

The loader's state is the rows consumed (plus, for streamed sources, every lane's position,
gathered from the ranks that read them), the same on every rank: a run resumes under any layout and any global batch size exactly after the
last row it trained on. It also holds the data's fingerprint (source, its size and content hash,
tokenizer, sequence length, shuffling seed): resuming on other data is an error unless
checkpoint.accept_data_change says it is meant.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from trainer.config.validation import WHOLE_SPLIT
from trainer.data.documents import DataError
from trainer.data.finite_sources import DataExhausted, FiniteTokenSource
from trainer.data.prefetch import RowPrefetcher
from trainer.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


# The settings behind a fingerprint's entries, named in the message when they change.
SETTING_OF = {"seq_len": "training.seq_len", "shuffle_seed": "training.data_seed, or debug.seed when unset",
              "stream_lanes": "training.stream_lanes",
              "tokenizer_sha256": "model.tokenizer_path, or model.hf_assets_path's tokenizer when unset"}


class LocalPeers:
    """The other data-parallel readers, seen from a single process: there are none."""

    @staticmethod
    def gather(obj) -> list:
        return [obj]

    @staticmethod
    def any(flag: bool) -> bool:
        return flag


class ProcessGroupPeers:
    """Every rank of the job: streamed lanes are read by some ranks only, so their positions are
    gathered for checkpoints, and the end of a lane is agreed on before anyone stops."""

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def gather(obj) -> list:
        import torch.distributed as dist

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


class BatchLoader:
    """pad_uneven (evaluation): a global batch that does not split into whole local batches per
    DP rank is padded with sequences whose labels are ignored, so the same global batch (and
    loss) serves every layout; every rank still runs the same number of microbatches.
    end_row (evaluation of a whole finite split, set by evaluation_batches): rows from it on are
    padding too, so the last batch ends with the split.
    document_eos (document masking): labels following this token (EOS) are ignored."""

    def __init__(self, source, *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, device: torch.device, name: str = "training",
                 accept_data_change: bool = False, pad_uneven: bool = False, document_eos: int | None = None,
                 peers=LocalPeers(), workers=None):
        rows_per_rank = -(-global_batch_size // dp_degree)
        if not pad_uneven and (global_batch_size % dp_degree or rows_per_rank % local_batch_size):
            raise ValueError(
                f"global batch {global_batch_size} does not split into {dp_degree} data-parallel ranks "
                f"x whole local batches of {local_batch_size}"
            )
        if not source.random_access and global_batch_size % source.lanes:
            raise ValueError(f"{name}: global batch {global_batch_size} does not split into the stream's "
                             f"{source.lanes} lanes (training.stream_lanes)")
        self.peers = peers
        self.source = source
        self.row_length = seq_len + 1  # inputs and labels are the row shifted by one token
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.rows_per_rank = rows_per_rank
        self.microbatches = -(-rows_per_rank // local_batch_size)
        # This rank's rows of a global batch: [own_first, own_stop) (empty for a trailing rank of
        # a padded batch smaller than the DP degree).
        self.own_first = min(dp_rank * rows_per_rank, global_batch_size)
        self.own_stop = min(self.own_first + rows_per_rank, global_batch_size)
        self.dp_rank = dp_rank
        self.device = device
        self.name = name
        self.rows_consumed = 0
        self.epoch = 0
        self.accept_data_change = accept_data_change
        self.document_eos = document_eos  # document masking: the token after an EOS is no target
        self.pad_uneven = pad_uneven
        self.end_row: int | None = None
        self._initial_source_state = None if source.random_access else source.state_dict()
        self._saved_keys: set[str] | None = None  # the keys of the checkpoint about to be loaded
        # `workers` ([training.dataloader]): rows of the coming batches read ahead (prefetch.py).
        self.prefetch = None
        if workers is not None and workers.num_workers > 0 and source.random_access:
            self.prefetch = RowPrefetcher(source, workers, stride=global_batch_size, offset=self.own_first,
                                          count=self.own_stop - self.own_first, length=self.row_length)
        elif workers is not None and workers.num_workers > 0:
            logger.warning("%s.dataloader.num_workers: a streamed dataset reads ahead in its own tokenizer workers "
                           "(training.stream_workers, stream_prefetch); these are not started", name)

    @property
    def accumulation_steps(self) -> int:
        return self.microbatches

    def _rank_rows(self):
        first, count = self.rows_consumed, self.own_stop - self.own_first
        if self.end_row is not None:  # a whole split: this rank's rows that are before its end
            start = min(first + self.own_first, self.end_row)
            count = min(first + self.own_stop, self.end_row) - start
            return self.source.rows(start, count, self.row_length) if count else \
                np.zeros((0, self.row_length), dtype=np.int64)
        if self.source.random_access:
            # Decided on the whole global batch, so every rank stops at the same step (a rank
            # whose own rows still exist must not train on while its peers have stopped).
            self.source.check_available(first + self.global_batch_size - 1, self.row_length)
            if self.prefetch is not None:
                return self.prefetch.rows(first)
            return self.source.rows(first + self.own_first, count, self.row_length)
        return self._agreed(lambda: self.source.batch_rows(first, self.global_batch_size, self.own_first,
                                                           self.own_stop, self.row_length))

    def _agreed(self, read):
        """A stream's rows, once every rank knows whether all of them got theirs: a lane that does
        not wrap may end on one rank while the others still read."""
        if self.source.wrap:
            return read()
        try:
            rows, ended = read(), None
        except DataExhausted as e:
            rows, ended = None, e
        if self.peers.any(ended is not None):
            raise ended or DataExhausted(f"{self.name} data: a stream lane read by another rank ended")
        return rows

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches (inputs, labels) of the next global batch.
        Raises DataExhausted when a finite source ends and is configured to stop."""
        rows = self._rank_rows()
        self.rows_consumed += self.global_batch_size
        epoch = self.source.epoch_of(self.rows_consumed - 1, self.row_length)
        if epoch != self.epoch:
            logger.info("%s data: epoch %d begins in the global batch of sequences %d-%d", self.name, epoch,
                        self.rows_consumed - self.global_batch_size, self.rows_consumed - 1)
            self.epoch = epoch
        tokens = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(rows)
        padding = self.microbatches * self.local_batch_size - len(rows)
        if padding:
            tokens = torch.cat([tokens, torch.zeros(padding, self.row_length, dtype=tokens.dtype)])
        if self.device.type == "cuda":
            # One asynchronous copy from page-locked memory: the host does not wait for the device.
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
        else:
            tokens = tokens.to(self.device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]  # views of one copy on the device
        if padding or self.document_eos is not None:
            labels = labels.clone()
            labels[len(rows):] = IGNORE_INDEX
            if self.document_eos is not None:  # the next document's first token follows the EOS
                labels[inputs == self.document_eos] = IGNORE_INDEX
        return list(zip(inputs.split(self.local_batch_size), labels.split(self.local_batch_size)))

    def fingerprint(self) -> dict:
        """What decides the rows: the source's identity and the sequence length."""
        return {**self.source.fingerprint(), "seq_len": self.row_length - 1}

    def expect_saved_keys(self, keys: set[str]) -> None:
        """Before loading: the checkpoint's keys for the loader, flattened ("source.carry"). The
        next state_dict, which DCP fills, holds only those: a checkpoint of an earlier version
        has `step` where this one has `rows_consumed`, and may lack keys added since."""
        self._saved_keys = keys

    def state_dict(self) -> dict:
        state = {"rows_consumed": self.rows_consumed, "epoch": self.epoch, "global_batch_size": self.global_batch_size,
                 "fingerprint": json.dumps(self.fingerprint(), sort_keys=True)} | self._stream_state()
        if self._saved_keys is None:
            return state
        return only_saved({**state, "step": 0}, self._saved_keys)

    def _stream_state(self) -> dict:
        if self.source.random_access:
            return {}
        return {"source": self.source.merge_states(self.peers.gather(self.source.state_dict()))}

    def load_state_dict(self, state: dict) -> None:
        changed: set[str] = set()
        if "rows_consumed" in state:
            changed = self._check_same_data(json.loads(state["fingerprint"]))
            rows, saved_batch = int(state["rows_consumed"]), int(state["global_batch_size"])
        else:
            logger.warning("%s data: the checkpoint predates data fingerprints and records global batches, not "
                           "sequences; assuming it used this run's data and global batch size", self.name)
            rows, saved_batch = int(state["step"]) * self.global_batch_size, self.global_batch_size
        self._saved_keys = None
        self.rows_consumed = rows
        if not self.source.random_access:
            self.source.load_state_dict(state.get("source", {}), rows_consumed=rows, changed=changed)
        self.epoch = self.source.epoch_of(rows - 1, self.row_length) if rows else 0
        if saved_batch != self.global_batch_size:
            logger.info("%s data: the checkpoint's global batch was %d sequences, this run's is %d: continuing after "
                        "sequence %d, the last one trained", self.name, saved_batch, self.global_batch_size, rows)

    def _check_same_data(self, saved: dict) -> set[str]:
        """The fingerprint keys that changed (accepted), or DataError."""
        current = self.fingerprint()
        keys = {key for key in set(saved) | set(current) if saved.get(key) != current.get(key)}
        if not keys:
            return keys
        changed = [f"{key} {saved.get(key)!r} -> {current.get(key)!r}" + (f" ({SETTING_OF[key]})" if key in SETTING_OF
                                                                           else "") for key in sorted(keys)]
        message = f"{self.name} data differs from the checkpoint's: {'; '.join(changed)}"
        if not self.accept_data_change:
            raise DataError(f"{message}. Resume with the data it was trained on, or set "
                            "checkpoint.accept_data_change = true to go on with this data on purpose")
        logger.warning("%s (checkpoint.accept_data_change): continuing after the same number of sequences", message)
        return keys

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        if hasattr(self.source, "close"):
            self.source.close()

    def reset(self) -> None:
        """Back to the first batch (validation reads the same batches at every evaluation)."""
        self.rows_consumed, self.epoch = 0, 0
        if not self.source.random_access:
            self.source.load_state_dict(self._initial_source_state)


def only_saved(state: dict, saved: set[str], prefix: str = "") -> dict:
    """The part of a nested state dict whose flattened keys a checkpoint holds."""
    kept = {}
    for key, value in state.items():
        name = prefix + key
        if isinstance(value, dict):
            inner = only_saved(value, saved, name + ".")
            if inner:
                kept[key] = inner
        elif name in saved:
            kept[key] = value
    return kept


def evaluation_batches(loader: BatchLoader, steps: int) -> int:
    """The global batches one evaluation reads: `steps` (validation.steps), or with WHOLE_SPLIT
    (-1) as many as it takes to read every sequence of a finite split once, from its start, the
    last batch padded up to the global batch size. The loss is the same global mean whatever the
    layout, since each sequence counts once and padding counts for nothing."""
    if steps != WHOLE_SPLIT:
        check_evaluation_fits(loader, steps)
        return steps
    if not isinstance(loader.source, FiniteTokenSource) or not loader.pad_uneven:
        # The preflight refuses these (trainer.preflight.checks.check_validation); this is the backstop.
        raise DataError(f"validation.steps = -1: {loader.source.describe()['source']} is not a finite split of "
                        "known length ('files', 'c4_test', 'shards' or 'python_stdlib'); set validation.steps to a number of batches")
    check_not_empty(loader)
    available = loader.source.rows_per_epoch(loader.row_length)
    loader.end_row = available
    batches = -(-available // loader.global_batch_size)
    logger.info("%s data: one evaluation reads the whole split (validation.steps = -1): %d sequences of %d tokens "
                "in %d batches of %d", loader.name, available, loader.row_length - 1, batches,
                loader.global_batch_size)
    return batches


def check_not_empty(loader: BatchLoader) -> None:
    try:
        loader.source.check_available(0, loader.row_length)  # DataError when it holds no whole sequence
    except DataError as e:
        raise DataError(f"{e}: the validation split is empty for this sequence length; lower validation.seq_len, "
                        "hold out more documents (training.validation_fraction, or prepare --validation-fraction), "
                        "or set validation.dataset") from None


def check_evaluation_fits(loader: BatchLoader, steps: int) -> None:
    """An evaluation reads `steps` global batches from the start of the validation split: refuse
    a split without one whole sequence, and warn when an evaluation would read some twice."""
    if not hasattr(loader.source, "rows_per_epoch"):  # endless, or a stream of unknown length
        return
    available = loader.source.rows_per_epoch(loader.row_length)
    check_not_empty(loader)
    needed = steps * loader.global_batch_size
    if needed > available:
        logger.warning("%s data: one evaluation reads %d sequences of %d tokens but the split holds %d, so some are "
                       "read twice; lower validation.steps (or -1: the whole split, once), or add validation data",
                       loader.name, needed, loader.row_length - 1, available)
