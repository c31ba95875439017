"""Text tokenized as it is read: local files tokenized at start, and Hugging Face datasets streamed.

Documents are tokenized ([BOS] text [EOS]), concatenated, and cut into rows of `length` tokens
(non-overlapping). Row i is therefore a fixed function of the data, the tokenizer and the row
length, whatever the parallel layout.

- Local files (`training.dataset = "files"`) are tokenized once at start into memory
  (trainer.data.finite_sources.TokenArraySource): for small corpora; large ones are prepared
  into shards once (trainer.data.prepare).
- Hugging Face datasets by name are streamed in lanes (trainer.data.stream_lanes): each
  data-parallel rank reads and tokenizes (in worker processes, ahead of use) only the lanes its
  rows come from; the rows do not depend on the layout, and a run resumes under any layout.
  The same `load_dataset` call reads the hub or a local copy (dataset_path); a name may stand
  for a hub id, a config and a split (HUB_ALIASES: c4_validation is C4's validation split).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from trainer.data.documents import DataError, ReadCounts
from trainer.data.stream_lanes import Lane, LaneState, StreamFiles, start_worker_server

logger = logging.getLogger(__name__)

HUB_ALIASES = {  # short names -> (hub id, config, the split always read; None: the split asked for)
    "c4": ("allenai/c4", "en", None),
    "c4_validation": ("allenai/c4", "en", "validation"),  # torchtitan's configs' name for C4's validation split
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None),
}
# What a local copy (dataset_path) of a streamed dataset holds: `datasets` tells a folder's splits
# apart by the names of its files.
LOCAL_COPY = {
    "c4_validation": "a folder holding C4's validation files as the hub names them (en/c4-validation.00000-of-00008"
                     ".json.gz ... from huggingface.co/datasets/allenai/c4), or files of JSON lines with a \"text\" "
                     "field whose names say 'validation' (e.g. validation.jsonl)",
}
LOCAL_COPY_DEFAULT = ("a folder of the dataset's data files (.jsonl, .json, .parquet, optionally compressed) named by "
                      "split as on the hub, e.g. data/train-00000-of-00001.jsonl and "
                      "data/validation-00000-of-00001.jsonl")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets, streamed


class StreamingTextSource:
    """Rows of a streamed dataset read in lanes (trainer.data.stream_lanes): lane j holds rows
    [j*G/L, (j+1)*G/L) of every global batch of G rows, so a data-parallel rank reads only the
    lanes its rows fall in. Rows come in order only. State: every lane's position."""

    random_access = False
    entropy_floor = None

    def __init__(self, open_stream, tokenizer, *, text_field: str, name: str, wrap: bool = True, lanes: int = 1,
                 shuffle_seed: int | None = None, workers: int = 0, prefetch: int = 4):
        self.open_stream, self.tokenizer, self.text_field = open_stream, tokenizer, text_field
        self.name, self.wrap, self.lanes, self.shuffle_seed = name, wrap, lanes, shuffle_seed
        self.workers, self.prefetch = workers, prefetch
        self.counts = ReadCounts()
        self.states = {lane: LaneState() for lane in range(lanes)}  # this rank's lanes are current
        self.row_base = 0  # rows consumed when the lanes (re)started at the beginning of the data
        self._open: dict[int, Lane] = {}
        self._files: StreamFiles | None = None
        self._logged = False  # how the stream is read, said once
        if workers:
            start_worker_server()

    def files(self) -> StreamFiles:
        if self._files is None:
            self._files = StreamFiles(self.open_stream(), lanes=self.lanes, shuffle_seed=self.shuffle_seed,
                                      name=self.name)
        return self._files

    def _lane(self, lane: int) -> Lane:
        if lane not in self._open:
            self._open[lane] = Lane(self.files(), lane, self.tokenizer, self.states[lane], text_field=self.text_field,
                                    wrap=self.wrap, counts=self.counts, workers=self.workers, prefetch=self.prefetch)
        return self._open[lane]

    def batch_rows(self, rows_consumed: int, global_batch: int, first: int, stop: int, length: int) -> np.ndarray:
        """Rows [first, stop) of the global batch that starts after `rows_consumed` rows."""
        if stop <= first:
            return np.zeros((0, length), dtype=np.int64)
        per_lane = global_batch // self.lanes
        lanes = range(first // per_lane, (stop - 1) // per_lane + 1)
        if not self._logged:
            self._log_reading(lanes)
        parts = []
        for index in lanes:
            lane = self._lane(index)
            if self.row_base + lane.state.rows * self.lanes != rows_consumed:
                raise ValueError(f"{self.name}: streamed rows must be read in order (lane {index} is at row "
                                 f"{lane.state.rows}, asked for the batch after {rows_consumed} rows)")
            parts.append(lane.take(per_lane, length))
            self.states[index] = lane.state
        return np.concatenate(parts)[first - lanes[0] * per_lane:stop - lanes[0] * per_lane]

    def _log_reading(self, lanes: range) -> None:
        self._logged = True
        count = self.files().count
        own = f"lane {lanes[0]}" if len(lanes) == 1 else f"lanes {lanes[0]}-{lanes[-1]}"
        how = (f"by {self.workers} worker process{'es' if self.workers > 1 else ''} per lane" if self.workers
               else "in the training process")
        logger.info("%s: %d data files in %d lanes (file i in lane i mod %d); this rank reads %s, tokenized %s",
                    self.name, count, self.lanes, self.lanes, own, how)

    def epoch_of(self, row: int, length: int) -> int:
        return max((self.states[lane].position.epoch for lane in self._open), default=0)

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_id", None)

    def state_dict(self) -> dict:
        """Every lane's position as this rank knows it: its own lanes' current ones (the loader
        merges the ranks' states, keeping each lane's most advanced)."""
        return {"lanes": {str(lane): state.to_dict() for lane, state in self.states.items()}, "row_base": self.row_base}

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state from the ranks' states: each lane's from the rank that read furthest in it."""
        lanes = {}
        for state in states:
            for lane, lane_state in state["lanes"].items():
                if lane not in lanes or lane_state["rows"] > lanes[lane]["rows"]:
                    lanes[lane] = lane_state
        return {"lanes": lanes, "row_base": states[0].get("row_base", 0)}

    def load_state_dict(self, state: dict, *, rows_consumed: int = 0, changed: set[str] = frozenset()) -> None:
        """Restore the lanes' positions. When the data changed on purpose (checkpoint.accept_data_change)
        in a way that moves files between lanes or reorders them, the saved positions point into
        other files: the lanes then start at the beginning of the data, counting rows on."""
        self.close()
        moved = changed & {"stream_lanes", "data_files", "shuffle_seed", "source"}
        if moved or "lanes" not in state or len(state["lanes"]) != self.lanes:
            logger.warning("%s: the saved stream positions do not apply (%s): the lanes start at the beginning of the "
                           "data, after sequence %d", self.name, ", ".join(sorted(moved)) or "an earlier version's "
                           "position", rows_consumed)
            self.states = {lane: LaneState() for lane in range(self.lanes)}
            self.row_base = rows_consumed
            return
        self.states = {int(lane): LaneState.from_dict(s) for lane, s in state["lanes"].items()}
        self.row_base = int(state.get("row_base", 0))

    def close(self) -> None:
        """Stop the open lanes' reading threads and tokenizer processes."""
        for lane in self._open.values():
            lane.close()
        self._open = {}

    def describe(self) -> dict:
        return {"source": self.name, "streaming": True, "lanes": self.lanes,
                "skipped_records": sum(self.counts.skipped.values())}

    def fingerprint(self) -> dict:
        return {"source": self.name, "tokenizer_sha256": getattr(self.tokenizer, "sha256", None),
                "data_files": self.files().count, "stream_lanes": self.lanes, "shuffle_seed": self.shuffle_seed}


def hub_dataset(dataset: str, split: str) -> tuple[str, str | None, str]:
    """(hub id, config or None, split read) of a streamed dataset's name."""
    hub_id, config, fixed_split = HUB_ALIASES.get(dataset, (dataset, None, None))
    return hub_id, config, fixed_split or split


def hub_stream_opener(dataset: str, dataset_path: str, split: str, section: str = "training"):
    """A function opening the named dataset as a stream. dataset_path, when set, is a local copy
    (a folder of data files) loaded through the same `load_dataset` call instead of the hub.
    section: the config section naming the dataset, for messages."""
    import datasets

    hub_id, config, split = hub_dataset(dataset, split)

    def open_stream():
        try:
            if dataset_path:
                return datasets.load_dataset(dataset_path, split=split, streaming=True)
            return datasets.load_dataset(hub_id, config, split=split, streaming=True)
        except Exception as e:
            if dataset_path:
                raise DataError(f"{section}.dataset_path: cannot open {dataset_path!r} split {split!r} as a local copy "
                                f"of {dataset!r}: {type(e).__name__}: {e}; it should be "
                                f"{LOCAL_COPY.get(dataset, LOCAL_COPY_DEFAULT)}") from None
            raise DataError(f"{section}.dataset: cannot open {hub_id!r} split {split!r}: "
                            f"{type(e).__name__}: {e}") from None

    return open_stream


def check_stream_location(dataset: str, dataset_path: str, section: str) -> None:
    """Before any work, without reading data: the local copy exists, or the dataset can come from
    the hub, or (offline) from the Hugging Face cache. Raises DataError naming the key."""
    what = LOCAL_COPY.get(dataset, LOCAL_COPY_DEFAULT)
    if dataset_path:
        if not os.path.exists(dataset_path):
            raise DataError(f"{section}.dataset_path: {dataset_path!r} does not exist; for dataset {dataset!r} it is a "
                            f"local copy: {what}")
        return
    offline = next((v for v in OFFLINE_VARIABLES if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")), None)
    hub_id, config, fixed_split = HUB_ALIASES.get(dataset, (dataset, None, None))
    if offline and not _in_hf_cache(hub_id):
        shown = ", ".join([hub_id] + [f"config {config}"] * bool(config) + [f"split {fixed_split}"] * bool(fixed_split))
        raise DataError(f"{section}.dataset_path: dataset {dataset!r} is streamed from the Hugging Face hub ({shown}), "
                        f"which {offline}=1 turns off, and the Hugging Face datasets cache ({_hf_cache()}) does not "
                        f"hold it: set {section}.dataset_path to a local copy, {what}")


def _hf_cache() -> str:
    """The `datasets` cache folder, as the library finds it from the environment."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "datasets")


def _in_hf_cache(hub_id: str) -> bool:
    """Whether the cache holds a folder of `hub_id` (as owner___name; the library writes the
    name in snake case, so case and underscores are ignored here). Only its absence is certain:
    the folder may lack the config or split, which opening the stream then says."""
    wanted = hub_id.replace("/", "").replace("_", "").lower()
    try:
        entries = os.listdir(_hf_cache())
    except OSError:
        return False
    return any(entry.replace("_", "").lower() == wanted for entry in entries)
