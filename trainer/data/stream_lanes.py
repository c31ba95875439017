"""Lanes of a streamed dataset: independent streams of documents, tokenized ahead in worker processes.

A streamed dataset of F data files is read in L lanes (training.stream_lanes): file i belongs to
lane i mod L, and each lane goes through its files epoch after epoch, in an order that is a
seeded permutation of (data seed, lane, epoch) when shuffling. A lane is a stream of documents,
tokenized ([BOS] text [EOS]) and concatenated; its rows are consecutive pieces of that token
stream. Which tokens a lane holds depends only on the data, the seed and L, never on the parallel
layout, so the data-parallel ranks can split the lanes between them (each reading and tokenizing
only its own) and the batch at every step is still the same in every layout.

Reading runs in the training process (a background thread: `datasets` parses records at
~100 MB/s of text, well ahead of tokenization); tokenizing runs in `workers` processes per lane
(torchdata.nodes ParallelMapper, in order) with `prefetch` chunks held ready (Prefetcher). A
chunk is up to CHUNK_CHARS of text from one file, handed out with the position where it starts.

A lane's state is the position of the first chunk not fully consumed (epoch, file in that
epoch's order, records read in the file, and the `datasets` state there) plus the tokens of that
chunk already consumed: a resume opens that file at that record (not reading the files before
it), tokenizes the chunk again and drops the consumed tokens.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from trainer.data.documents import DataError, ReadCounts, record_text
from trainer.data.finite_sources import DataExhausted
from trainer.data.shuffle import permute
from trainer.data.tokenizer import tokenize_documents
from trainer.forkserver import preloaded_context

logger = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 18  # text per chunk (~64k tokens): large enough that worker hand-offs cost little
CHUNK_DOCUMENTS = 1024


@dataclass(frozen=True)
class Position:
    """Where a chunk starts: `records` records into file `file` of epoch `epoch`'s order, with
    the dataset's own state there (JSON; empty at the start of a file)."""

    epoch: int = 0
    file: int = 0
    records: int = 0
    file_state: str = ""


@dataclass
class LaneState:
    """A lane's progress: rows handed out, and the token stream's position (`offset` tokens into
    the chunk starting at `position`)."""

    rows: int = 0
    position: Position = Position()
    offset: int = 0

    def to_dict(self) -> dict:
        return {"rows": self.rows, "offset": self.offset, **asdict(self.position)}

    @classmethod
    def from_dict(cls, state: dict) -> "LaneState":
        position = Position(int(state["epoch"]), int(state["file"]), int(state["records"]), str(state["file_state"]))
        return cls(int(state["rows"]), position, int(state["offset"]))


class StreamFiles:
    """A streamed dataset opened once, split into its data files (the `datasets` shards), and
    the lanes' file orders."""

    def __init__(self, dataset, *, lanes: int, shuffle_seed: int | None, name: str):
        self.dataset, self.lanes, self.shuffle_seed, self.name = dataset, lanes, shuffle_seed, name
        self.count = int(getattr(dataset, "num_shards", 1))
        if lanes > self.count:
            raise DataError(f"training.stream_lanes: {lanes} lanes, but {name} has {self.count} data file"
                            f"{'s' if self.count > 1 else ''}, and each lane reads its own files: use at most "
                            f"{self.count} lanes, or prepare the data into shards (python -m trainer.data.prepare)")

    def lane_files(self, lane: int) -> list[int]:
        return list(range(lane, self.count, self.lanes))

    def order(self, lane: int, epoch: int) -> list[int]:
        """The lane's files in epoch `epoch`: a permutation of (seed, lane, epoch), or file order."""
        files = self.lane_files(lane)
        if self.shuffle_seed is None:
            return files
        places = permute(np.arange(len(files)), len(files), self.shuffle_seed * 1_000_003 + lane, epoch)
        return [files[p] for p in places]

    def open(self, index: int):
        """A new stream over one data file (a new object: restoring a position changes it)."""
        return self.dataset.shard(num_shards=self.count, index=index)


def read_chunks(files: StreamFiles, lane: int, start: Position, *, text_field: str, wrap: bool, counts: ReadCounts):
    """The lane's text from `start` on, as ("chunk", position, texts) items; ("end", message) when
    a lane that does not wrap runs out; ("error", exception) for a bad record. (Errors travel as
    items so they reach the trainer as raised, not re-wrapped by the worker machinery.)"""
    try:
        yield from _chunks(files, lane, start, text_field=text_field, wrap=wrap, counts=counts)
    except (DataError, OSError, ValueError) as e:
        yield ("error", e)


def _chunks(files: StreamFiles, lane: int, start: Position, *, text_field, wrap, counts):
    epoch, file, records, file_state = start.epoch, start.file, start.records, start.file_state
    while True:
        order, found_any = files.order(lane, epoch), False
        for place in range(file, len(order)):
            stream = files.open(order[place])
            if file_state:
                stream.load_state_dict(json.loads(file_state))  # straight to the record
            elif records:
                stream = stream.skip(records)  # a position saved without the dataset's state
            chunk_start, texts, size = Position(epoch, place, records, file_state), [], 0
            for record in stream:
                records += 1
                text = record_text(record, text_field, f"{files.name} file {order[place]} record {records}",
                                   counts, files.name)
                if text is not None:
                    texts.append(text)
                    size += len(text)
                    found_any = True
                if size >= CHUNK_CHARS or len(texts) >= CHUNK_DOCUMENTS:
                    yield ("chunk", chunk_start, texts)
                    state = json.dumps(stream.state_dict()) if hasattr(stream, "state_dict") else ""
                    chunk_start, texts, size = Position(epoch, place, records, state), [], 0
            if texts:
                yield ("chunk", chunk_start, texts)
            records, file_state = 0, ""
        if not found_any and file == 0:  # else wrapping would read on forever without a row
            raise DataError(f"{files.name}: lane {lane} found no document (a record with text) in a whole pass "
                            f"over its data files {files.lane_files(lane)}")
        if not wrap:
            yield ("end", f"{files.name}: the stream ended (training.dataset_end = 'stop')")
            return
        epoch, file = epoch + 1, 0


class TokenizeChunk:
    """The worker's function: a chunk's texts -> their documents' tokens, concatenated.
    Picklable, so it runs in worker processes, which end with the training process."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.owner = os.getpid()

    def __setstate__(self, state: dict) -> None:  # unpickled: in a worker process, as it starts
        self.__dict__.update(state)
        exit_with(self.owner)

    def __call__(self, item):
        if item[0] != "chunk":
            return item
        _, position, texts = item
        return ("chunk", position, tokenize_documents(texts, self.tokenizer))


def exit_with(pid: int, interval_s: float = 1.0) -> None:
    """End this process once process `pid` is gone. A worker waits for work in a loop that only
    stops when told to: a training process that dies without closing its lanes (killed, or ended
    by os._exit after an error on another rank) would leave its workers, and their fork server,
    running for ever."""

    def watch():
        while process_alive(pid):
            time.sleep(interval_s)
        os._exit(0)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs: not gone, and not a zombie (dead, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


WORKER_MODULES = ["trainer.data.worker_server", "torchdata.nodes", "trainer.data.stream_lanes",
                  "trainer.data.tokenizer"]


def worker_context() -> str:
    """The workers' start method (trainer/forkserver.py): the fork server where there is one."""
    return preloaded_context(WORKER_MODULES).get_start_method()


def start_worker_server() -> None:
    """Start the fork server now, with what a worker needs already imported, so that the first
    lane's workers start at once. A worker runs the program's main module again (multiprocessing
    does that): when it is a module run by name (`python -m trainer.train`), the server imports
    it once, and each worker re-runs it with every import in place (a few ms, not seconds)."""
    modules = list(WORKER_MODULES)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        modules.append(spec.name)
    if preloaded_context(modules).get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    forkserver.ensure_running()  # returns at once; the server imports in the background


def tokenized_chunks(chunks, tokenize: TokenizeChunk, *, workers: int, prefetch: int):
    """(iterator of tokenized items, close function). workers = 0: tokenized in this thread as read."""
    if workers == 0:
        return map(tokenize, chunks), lambda: None
    import torchdata.nodes as nodes

    mapped = nodes.ParallelMapper(nodes.IterableWrapper(chunks), tokenize, num_workers=workers, in_order=True,
                                  method="process", multiprocessing_context=worker_context())
    pipeline = nodes.Prefetcher(mapped, prefetch_factor=max(1, prefetch))
    pipeline.reset()
    holder = [pipeline]

    def close():  # the nodes stop their threads and worker processes when released
        holder.clear()
        gc.collect()  # now, not at exit: their queues' semaphores are then released before the process ends

    return _Released(holder), close


class _Released:
    """Iterates the pipeline while it is held; StopIteration once closed."""

    def __init__(self, holder: list):
        self.holder = holder

    def __iter__(self):
        return self

    def __next__(self):
        if not self.holder:
            raise StopIteration
        return next(self.holder[0])


class Lane:
    """One lane's rows, cut from its tokenized chunks. Restored from a LaneState."""

    def __init__(self, files: StreamFiles, lane: int, tokenizer, state: LaneState, *, text_field: str, wrap: bool,
                 counts: ReadCounts, workers: int, prefetch: int):
        self.files, self.lane, self.state = files, lane, state
        chunks = read_chunks(files, lane, state.position, text_field=text_field, wrap=wrap, counts=counts)
        self._items, self._close = tokenized_chunks(chunks, TokenizeChunk(tokenizer), workers=workers,
                                                    prefetch=prefetch)
        self._buffer: deque[tuple[Position, np.ndarray]] = deque()  # chunks not fully consumed, oldest first
        self._skip = state.offset  # tokens of the first chunk consumed before the restore

    @property
    def epoch(self) -> int:
        return self.state.position.epoch

    def _pull(self) -> None:
        item = next(self._items, None)
        if item is None:  # read past an end already reported, or the pipeline closed
            raise DataExhausted(f"{self.files.name}: the stream ended (training.dataset_end = 'stop')")
        kind, *rest = item
        if kind == "error":
            raise rest[0]
        if kind == "end":
            raise DataExhausted(rest[0])
        self._buffer.append((rest[0], rest[1]))

    def take(self, count: int, length: int) -> np.ndarray:
        """The lane's next `count` rows of `length` tokens."""
        needed = count * length
        while sum(len(tokens) for _, tokens in self._buffer) - self._skip < needed:
            self._pull()
        joined = np.concatenate([tokens for _, tokens in self._buffer])[self._skip:self._skip + needed]
        consumed = self._skip + needed
        while self._buffer and len(self._buffer[0][1]) <= consumed:
            consumed -= len(self._buffer.popleft()[1])
        self._skip = consumed
        position = self._buffer[0][0] if self._buffer else self._next_position()
        if position.epoch > self.epoch:  # told when used: the reading runs chunks ahead
            logger.info("%s lane %d: epoch %d begins", self.files.name, self.lane, position.epoch)
        self.state = LaneState(self.state.rows + count, position, consumed)
        return joined.reshape(count, length).astype(np.int64)

    def _next_position(self) -> Position:
        """Every chunk read is consumed whole: the next one's position (read now, kept). At the
        end of a lane that does not wrap: past its last file, where a resume finds the end."""
        try:
            self._pull()
        except DataExhausted:
            return Position(self.epoch, len(self.files.lane_files(self.lane)))
        return self._buffer[0][0]

    def close(self) -> None:
        self._close()
