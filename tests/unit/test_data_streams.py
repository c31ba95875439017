"""Streamed datasets: lanes, layout invariance, resume under another layout or global batch, the
shuffled file order, tokenizer worker processes, the end of a stream and mistakes."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.unit.test_data import DOCS, SEQ, ByteTokenizer, global_batch_rows
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError
from trainer.data import stream_lanes
from trainer.data.documents import DataError
from trainer.data.finite_sources import DataExhausted
from trainer.data.loader import BatchLoader
from trainer.data.stream_lanes import StreamFiles
from trainer.data.text_sources import StreamingTextSource, hub_stream_opener
from trainer.parallel.dims import ParallelDims
from trainer.preflight.checks import check_stream_lanes


def write_hub(folder, files: int = 4, docs: list[str] = DOCS[:60]):
    """A hub-style folder: the documents dealt into `files` train files, file i holding a
    contiguous block; and a validation file."""
    (folder / "data").mkdir(parents=True)
    per_file = len(docs) // files
    for index in range(files):
        block = docs[index * per_file:(index + 1) * per_file]
        (folder / "data" / f"train-{index:05d}-of-{files:05d}.jsonl").write_text(
            "".join(json.dumps({"text": d}) + "\n" for d in block))
    (folder / "data" / "validation-00000-of-00001.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    return folder


def stream(folder, *, lanes=1, workers=0, seed=None, wrap=True, field="text", split="train"):
    return StreamingTextSource(hub_stream_opener("c4", str(folder), split), ByteTokenizer(), text_field=field,
                               name=f"c4:{split}", wrap=wrap, lanes=lanes, shuffle_seed=seed, workers=workers)


class GatherAll:
    """The peers of loaders living in one process: gathering asks each loader's source."""

    def __init__(self):
        self.ranks: list[BatchLoader] = []

    def gather(self, obj) -> list:
        return [loader.source.state_dict() for loader in self.ranks]

    @staticmethod
    def any(flag: bool) -> bool:
        return flag


def ranks(make, dp: int, global_batch: int = 8, local: int | None = None) -> list[BatchLoader]:
    peers = GatherAll()
    peers.ranks = [BatchLoader(make(), seq_len=SEQ, global_batch_size=global_batch,
                               local_batch_size=local or global_batch // dp, dp_rank=r, dp_degree=dp,
                               device=torch.device("cpu"), peers=peers) for r in range(dp)]
    return peers.ranks


def tokens_of(docs) -> np.ndarray:
    return np.concatenate([ByteTokenizer().encode_document(d) for d in docs])


def test_one_lane_reads_the_documents_in_file_order(tmp_path):
    write_hub(tmp_path / "c4", files=2)
    [loader] = ranks(lambda: stream(tmp_path / "c4"), 1, global_batch=4)
    rows = np.concatenate([torch.cat([i for i, _ in loader.next_batch()]).numpy() for _ in range(3)])
    expected = tokens_of(DOCS[:60])[:12 * (SEQ + 1)].reshape(12, SEQ + 1)[:, :SEQ]
    assert np.array_equal(rows, expected)
    validation = stream(tmp_path / "c4", split="validation")
    assert validation.batch_rows(0, 1, 0, 1, 5).tolist() == [ByteTokenizer().encode_document("held out")[:5]]


def test_lane_j_reads_files_j_j_plus_lanes_and_fills_its_block_of_every_batch(tmp_path):
    write_hub(tmp_path / "c4", files=4)
    [loader] = ranks(lambda: stream(tmp_path / "c4", lanes=2), 1, global_batch=4)
    batches = [global_batch_rows([loader]).numpy() for _ in range(5)]
    lane0 = tokens_of(DOCS[0:15] + DOCS[30:45])[:10 * (SEQ + 1)].reshape(10, SEQ + 1)
    lane1 = tokens_of(DOCS[15:30] + DOCS[45:60])[:10 * (SEQ + 1)].reshape(10, SEQ + 1)
    for step, batch in enumerate(batches):  # rows 0-1 from lane 0, rows 2-3 from lane 1
        assert np.array_equal(batch[:2], lane0[2 * step:2 * step + 2])
        assert np.array_equal(batch[2:], lane1[2 * step:2 * step + 2])


LAYOUTS = {"dp1 x bs8": (1, 8), "dp2 x bs4": (2, 4), "dp4 x bs2": (4, 2), "dp2 x bs2 x 2 accumulation": (2, 2)}


def test_lanes_give_the_same_batches_in_every_layout_and_each_rank_reads_only_its_own(tmp_path):
    write_hub(tmp_path / "c4", files=4)
    reference = None
    for name, (dp, local) in LAYOUTS.items():
        loaders = ranks(lambda: stream(tmp_path / "c4", lanes=4, seed=3), dp, local=local)
        batches = torch.stack([global_batch_rows(loaders) for _ in range(70)])  # into every lane's third epoch
        reference = batches if reference is None else reference
        assert torch.equal(batches, reference), name
        opened = [sorted(loader.source._open) for loader in loaders]
        assert opened == [list(range(r * 4 // dp, (r + 1) * 4 // dp)) for r in range(dp)], name
    assert any(loader.source.epoch_of(0, 0) >= 2 for loader in loaders)


def test_shuffling_permutes_each_lanes_files_anew_every_epoch():
    files = StreamFiles(SimpleNamespace(num_shards=40), lanes=4, shuffle_seed=7, name="c4:train")
    orders = [files.order(lane=1, epoch=e) for e in range(4)]
    assert all(sorted(order) == list(range(1, 40, 4)) for order in orders)
    assert len({tuple(order) for order in orders}) == 4  # a new order every epoch
    assert files.order(1, 0) == StreamFiles(SimpleNamespace(num_shards=40), lanes=4, shuffle_seed=7, name="x").order(1, 0)
    assert files.order(1, 0) != StreamFiles(SimpleNamespace(num_shards=40), lanes=4, shuffle_seed=8, name="x").order(1, 0)
    assert StreamFiles(SimpleNamespace(num_shards=40), lanes=4, shuffle_seed=None, name="x").order(1, 3) == \
        list(range(1, 40, 4))


@pytest.mark.parametrize("new_global_batch,new_dp", [(16, 4), (4, 2)])
def test_resume_with_another_global_batch_continues_every_lane_after_its_last_row(tmp_path, new_global_batch, new_dp):
    write_hub(tmp_path / "c4", files=4)
    make = lambda: stream(tmp_path / "c4", lanes=4, seed=1)  # noqa: E731
    # One row per lane per batch: reference[r][j] is lane j's row r.
    single = ranks(make, 1, global_batch=4)
    reference = torch.stack([global_batch_rows(single) for _ in range(24)])
    first = ranks(make, 2, global_batch=8)
    for _ in range(5):  # 10 rows of every lane
        global_batch_rows(first)
    own = first[0].source.state_dict()["lanes"]
    assert [own[str(lane)]["rows"] for lane in range(4)] == [10, 10, 0, 0]  # rank 0 read lanes 0 and 1 only
    state = json.loads(json.dumps(first[0].state_dict()))  # gathered from both ranks
    assert state == first[1].state_dict() and state["rows_consumed"] == 40
    assert [state["source"]["lanes"][str(lane)]["rows"] for lane in range(4)] == [10] * 4
    resumed = ranks(make, new_dp, global_batch=new_global_batch)
    for loader in resumed:
        loader.load_state_dict(state)
    per_lane = new_global_batch // 4
    for batch in range(24 // per_lane - 10 // per_lane - 1):
        rows = global_batch_rows(resumed)
        for index, row in enumerate(rows):
            lane, lane_row = index // per_lane, 10 + batch * per_lane + index % per_lane
            assert torch.equal(row, reference[lane_row][lane]), (batch, index)


def test_worker_processes_tokenize_the_same_rows_and_resume_inside_a_chunk(tmp_path):
    write_hub(tmp_path / "c4", files=2)
    inline = ranks(lambda: stream(tmp_path / "c4", lanes=2, seed=2), 1)
    expected = [global_batch_rows(inline) for _ in range(12)]
    workers = ranks(lambda: stream(tmp_path / "c4", lanes=2, seed=2, workers=1), 2)
    try:
        for step in range(5):
            assert torch.equal(global_batch_rows(workers), expected[step]), step
        state = json.loads(json.dumps(workers[0].state_dict()))
    finally:
        for loader in workers:
            loader.close()
    assert all(lane["offset"] > 0 for lane in state["source"]["lanes"].values())  # inside a chunk
    resumed = ranks(lambda: stream(tmp_path / "c4", lanes=2, seed=2, workers=1), 1)
    try:
        resumed[0].load_state_dict(state)
        for step in range(5, 12):
            assert torch.equal(global_batch_rows(resumed), expected[step]), step
    finally:
        resumed[0].close()


def test_a_resume_opens_the_file_at_its_record_without_reading_the_files_before(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_lanes, "CHUNK_DOCUMENTS", 4)  # chunks start inside files
    write_hub(tmp_path / "c4", files=4)
    whole = len(tokens_of(DOCS[:60])) // (SEQ + 1) // 8  # global batches in one epoch
    reference = ranks(lambda: stream(tmp_path / "c4"), 1)
    expected = [global_batch_rows(reference) for _ in range(whole)]
    first = ranks(lambda: stream(tmp_path / "c4"), 1)
    for _ in range(whole - 3):  # into the fourth file
        global_batch_rows(first)
    lane = first[0].state_dict()["source"]["lanes"]["0"]
    assert lane["file"] == 3 and lane["records"] > 0 and lane["file_state"]
    # The second file is damaged after the save: a resume that read it again would fail. (The
    # first one is read by `datasets` to learn the records' fields whenever a stream opens.)
    (tmp_path / "c4" / "data" / "train-00001-of-00004.jsonl").write_text("not json\n" * 15)
    resumed = ranks(lambda: stream(tmp_path / "c4"), 1)
    resumed[0].load_state_dict(first[0].state_dict())
    for step in range(whole - 3, whole):
        assert torch.equal(global_batch_rows(resumed), expected[step]), step


def test_the_end_of_a_lane_stops_every_rank_at_the_same_batch(tmp_path):
    write_hub(tmp_path / "c4", files=2)
    [alone] = ranks(lambda: stream(tmp_path / "c4", lanes=2, wrap=False), 1)
    batches = 0
    with pytest.raises(DataExhausted, match="c4:train: the stream ended"):
        while True:
            alone.next_batch()
            batches += 1
    per_lane = [len(tokens_of(DOCS[:30])), len(tokens_of(DOCS[30:60]))]
    assert batches == min(tokens // (4 * (SEQ + 1)) for tokens in per_lane)  # the shorter lane ends it
    told = BatchLoader(stream(tmp_path / "c4", lanes=2, wrap=False), seq_len=SEQ, global_batch_size=8,
                       local_batch_size=4, dp_rank=1, dp_degree=2, device=torch.device("cpu"),
                       peers=SimpleNamespace(any=lambda flag: True))  # another rank's lane ended
    with pytest.raises(DataExhausted, match="a stream lane read by another rank ended"):
        told.next_batch()


def test_records_without_text_are_skipped_and_counted(tmp_path):
    (tmp_path / "c4" / "data").mkdir(parents=True)
    records = [{"text": "one"}, {"text": None}, {"text": "  "}, {"text": "two"}]
    (tmp_path / "c4" / "data" / "train-00000-of-00001.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    source = stream(tmp_path / "c4")
    rows = source.batch_rows(0, 1, 0, 1, 9)  # within the first pass (the next one counts them again)
    assert rows.tolist() == [tokens_of(["one", "two"])[:9].tolist()]
    assert source.describe()["skipped_records"] == 2
    (tmp_path / "c4" / "data" / "train-00000-of-00001.jsonl").write_text(json.dumps({"text": None}) + "\n")
    with pytest.raises(DataError, match="lane 0 found no document .* in a whole pass over its data files \\[0\\]"):
        stream(tmp_path / "c4").batch_rows(0, 1, 0, 1, 9)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_record_without_the_text_field_is_named(tmp_path, workers):
    write_hub(tmp_path / "c4", files=1)
    source = stream(tmp_path / "c4", field="body", workers=workers)
    try:
        with pytest.raises(DataError, match="c4:train file 0 record 1 has no field 'body'; its fields are text"):
            source.batch_rows(0, 1, 0, 1, 10)
    finally:
        source.close()


def test_stream_mistakes_are_named(tmp_path, caplog):
    write_hub(tmp_path / "c4", files=2)
    with pytest.raises(DataError, match="training.stream_lanes: 4 lanes, but c4:train has 2 data files"):
        stream(tmp_path / "c4", lanes=4).batch_rows(0, 4, 0, 4, 10)
    with pytest.raises(ValueError, match="global batch 6 does not split into the stream's 4 lanes"):
        BatchLoader(stream(tmp_path / "c4", lanes=4), seq_len=SEQ, global_batch_size=6, local_batch_size=6,
                    dp_rank=0, dp_degree=1, device=torch.device("cpu"))
    with pytest.raises(DataError, match="cannot open"):
        hub_stream_opener("c4", str(tmp_path / "nothing-here"), "train")()
    [saved] = ranks(lambda: stream(tmp_path / "c4", lanes=2), 1)
    saved.next_batch()
    [other_lanes] = ranks(lambda: stream(tmp_path / "c4", lanes=1), 1)
    with pytest.raises(DataError, match="stream_lanes 2 -> 1"):
        other_lanes.load_state_dict(saved.state_dict())
    accepted = BatchLoader(stream(tmp_path / "c4", lanes=1), seq_len=SEQ, global_batch_size=4, local_batch_size=4,
                           dp_rank=0, dp_degree=1, device=torch.device("cpu"), accept_data_change=True)
    with caplog.at_level(logging.WARNING):
        accepted.load_state_dict(saved.state_dict())
    assert "the saved stream positions do not apply (stream_lanes): the lanes start at the beginning" in caplog.text
    [fresh] = ranks(lambda: stream(tmp_path / "c4", lanes=1), 1, global_batch=4)
    for _ in range(2):  # the data from its start, counted after the 8 sequences trained
        assert torch.equal(global_batch_rows([accepted]), global_batch_rows([fresh]))
    assert accepted.state_dict()["rows_consumed"] == 16 and accepted.state_dict()["source"]["row_base"] == 8
    (tmp_path / "c4" / "data" / "train-00002-of-00002.jsonl").write_text(json.dumps({"text": "new"}) + "\n")
    [more_files] = ranks(lambda: stream(tmp_path / "c4", lanes=2), 1)
    with pytest.raises(DataError, match="data_files 2 -> 3"):
        more_files.load_state_dict(saved.state_dict())


def test_preflight_names_lanes_that_do_not_split_the_global_batch(caplog):
    config = JobConfig()
    config.training.dataset, config.training.stream_lanes = "c4", 3
    dims = ParallelDims.from_config(config.parallelism, 2)
    with pytest.raises(ConfigError, match="training.stream_lanes: 3 lanes do not split the global batch of 16"):
        check_stream_lanes(config, dims, 16)
    config.training.stream_lanes = 4
    with caplog.at_level(logging.INFO, logger="trainer.preflight.checks"):
        check_stream_lanes(config, dims, 16)
    assert caplog.text == ""
    config.training.stream_lanes = 1
    with caplog.at_level(logging.INFO, logger="trainer.preflight.checks"):
        check_stream_lanes(config, dims, 16)
    assert "a multiple of 2 shares the reading evenly" in caplog.text


def test_tokenizer_workers_end_when_the_training_process_dies_without_closing(tmp_path):
    """A rank killed, or ended by os._exit, never closes its lanes: its workers must not live on."""
    import subprocess
    import sys
    import time

    from trainer.data.stream_lanes import process_alive

    write_hub(tmp_path / "c4", files=2)
    program = f"""
import multiprocessing, os
from tests.unit.test_data_streams import stream
from pathlib import Path
source = stream(Path({str(tmp_path / "c4")!r}), lanes=2, workers=1)
source.batch_rows(0, 4, 0, 4, 20)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
os._exit(1)
"""
    from tests.launch import REPO

    # Its output is read to the end, so the test also hangs if any worker keeps the pipes open.
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    workers = [int(pid) for pid in result.stdout.split()]
    assert len(workers) >= 2, result.stderr[-2000:]  # a tokenizer process per lane (and the tracker, maybe)

    deadline = time.monotonic() + 15
    while any(process_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(process_alive(pid) for pid in workers)
