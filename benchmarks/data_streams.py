"""Streamed datasets: what one data-parallel rank pays for its rows, by lanes and tokenizer workers.

    python benchmarks/data_streams.py [--text-mb 40] [--files 8] [--batches 200] [--step-ms 40]
                                      [--folder /tmp/stream-bench]

A hub-style folder of --files jsonl files (--text-mb MB of text in all) and a 512-piece
SentencePiece model are generated (kept under --folder). Every configuration builds the loader of
data-parallel rank 0 of a job with global batches of 16 sequences of 1024 tokens, read as a
Hugging Face dataset from that folder.

1. Reading as fast as it can, `--batches` global batches: the rank's tokens/s (its own rows) and
   what the whole job gets if every rank reads as fast (x DP degree). One lane read by every rank
   (stream_lanes = 1) is the design that tokenizes the global batch on every rank.
2. Inside a training loop that computes for --step-ms per step (a sleep: on GPUs the host is free
   while the device computes): the time the loop waits for data per step, with tokenization in
   the training process (stream_workers = 0) or in worker processes ahead of use, and the time to
   the first batch (worker start-up included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQ_LEN, GLOBAL_BATCH = 1024, 16


def generate(folder: Path, text_mb: float, files: int) -> tuple[Path, Path]:
    """(dataset folder, tokenizer model), reused when present."""
    from common import generated_jsonl_corpus, generated_tokenizer

    dataset = folder / f"hub-{text_mb:g}mb-{files}"
    generated_jsonl_corpus(dataset / "data", text_mb, [f"train-{i:05d}-of-{files:05d}.jsonl" for i in range(files)])
    return dataset, generated_tokenizer(folder)


def rank_zero_loader(dataset: Path, tokenizer: Path, *, lanes: int, dp: int, workers: int):
    import torch

    from trainer.data.loader import BatchLoader
    from trainer.data.text_sources import StreamingTextSource, hub_stream_opener
    from trainer.data.tokenizer import Tokenizer

    source = StreamingTextSource(hub_stream_opener("c4", str(dataset), "train"), Tokenizer(str(tokenizer)),
                                 text_field="text", name="bench:train", lanes=lanes, shuffle_seed=0, workers=workers)
    return BatchLoader(source, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, local_batch_size=GLOBAL_BATCH // dp,
                       dp_rank=0, dp_degree=dp, device=torch.device("cpu"))


def read_rate(loader, batches: int) -> float:
    """Tokens/s of the rank's own rows, after a first batch that starts the pipeline."""
    loader.next_batch()
    started = time.perf_counter()
    tokens = sum(inputs.numel() for _ in range(batches) for inputs, _ in loader.next_batch())
    return tokens / (time.perf_counter() - started)


def training_loop_wait(loader, batches: int, step_s: float) -> tuple[float, float]:
    """(seconds to the first batch, mean seconds waiting for data per step after it)."""
    started = time.perf_counter()
    loader.next_batch()
    first = time.perf_counter() - started
    waited = 0.0
    for _ in range(batches):
        time.sleep(step_s)
        started = time.perf_counter()
        loader.next_batch()
        waited += time.perf_counter() - started
    return first, waited / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=float, default=40)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=40)
    parser.add_argument("--folder", default="/tmp/stream-bench")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dataset, tokenizer = generate(Path(args.folder), args.text_mb, args.files)
    print(f"{args.text_mb:g} MB of jsonl in {args.files} files; global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens; "
          f"DP rank 0's loader; {os.cpu_count()} cores")
    print()
    print(f"{'lanes':>5} {'DP':>3} {'workers/lane':>12} {'lanes read':>10} {'rank tok/s':>12} {'job tok/s':>12}")
    for lanes, dp, workers in ((1, 1, 0), (1, 2, 0), (2, 2, 0), (2, 2, 1), (4, 2, 1), (8, 1, 1)):
        loader = rank_zero_loader(dataset, tokenizer, lanes=lanes, dp=dp, workers=workers)
        try:
            rate = read_rate(loader, args.batches)
            read = len(loader.source._open)
        finally:
            loader.close()
        print(f"{lanes:>5} {dp:>3} {workers:>12} {read:>10} {rate:>12,.0f} {rate * dp:>12,.0f}")
    print()
    print(f"training loop computing {args.step_ms:g} ms per step, DP 2, 2 lanes ({GLOBAL_BATCH // 2} x {SEQ_LEN} "
          "tokens per step for the rank)")
    print(f"{'tokenizing':<30} {'first batch s':>13} {'wait per step ms':>16}")
    for workers, label in ((0, "in the training process"), (1, "1 worker process per lane")):
        loader = rank_zero_loader(dataset, tokenizer, lanes=2, dp=2, workers=workers)
        try:
            first, wait = training_loop_wait(loader, min(args.batches, 100), args.step_ms / 1000)
        finally:
            loader.close()
        print(f"{label:<30} {first:>13.3f} {wait * 1000:>16.2f}")


if __name__ == "__main__":
    main()
