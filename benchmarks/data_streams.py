"""Streamed datasets: what one data-parallel rank pays for its rows, by lanes and tokenizer workers.

    python benchmarks/data_streams.py [--text-mb 40] [--files 8] [--tokens 6000000]
                                      [--warmup-tokens 1000000] [--step-ms 40] [--folder /tmp/stream-bench]

A hub-style folder of --files jsonl files (--text-mb MB of text in all) and a 512-piece
SentencePiece model are generated (kept under --folder). Every configuration builds the loader of
data-parallel rank 0 of a job with global batches of 16 sequences of 1024 tokens, read as a
Hugging Face dataset from that folder (wrapping around as needed).

Steady state only: before timing, every lane the rank reads uses --warmup-tokens, more than the
~6 chunks (~450k tokens) a lane with workers holds tokenized ahead; otherwise the timing would
measure the prefetched buffer, not the rate the pipeline sustains.

1. Reading as fast as it can until the rank has --tokens of its own rows: the rank's tokens/s and
   what the whole job gets if every rank reads as fast (x DP degree). One lane read by every rank
   (stream_lanes = 1) is the design that tokenizes the global batch on every rank.
2. Inside a training loop that computes for --step-ms per step (a sleep: on GPUs the host is free
   while the device computes): the time the loop waits for data per step over 100 steps, with
   tokenization in the training process (stream_workers = 0) or in worker processes ahead of use,
   and the time to the first batch (worker start-up included).
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


def warm_up(loader, lanes: int, tokens_per_lane: int) -> float:
    """Read until every lane has used `tokens_per_lane`; returns the seconds to the first batch."""
    started = time.perf_counter()
    loader.next_batch()
    first = time.perf_counter() - started
    per_batch = GLOBAL_BATCH // lanes * (SEQ_LEN + 1)
    for _ in range(-(-tokens_per_lane // per_batch) - 1):
        loader.next_batch()
    return first


def read_rate(loader, tokens: int) -> float:
    """Tokens/s of the rank's own rows while it reads `tokens` of them."""
    started, read = time.perf_counter(), 0
    while read < tokens:
        read += sum(inputs.numel() for inputs, _ in loader.next_batch())
    return read / (time.perf_counter() - started)


def training_loop_wait(loader, step_s: float, steps: int = 100) -> float:
    """Mean seconds the loop waits for data per step."""
    waited = 0.0
    for _ in range(steps):
        time.sleep(step_s)
        started = time.perf_counter()
        loader.next_batch()
        waited += time.perf_counter() - started
    return waited / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=float, default=40)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=6_000_000)
    parser.add_argument("--warmup-tokens", type=int, default=1_000_000)
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
            warm_up(loader, lanes, args.warmup_tokens)
            rate = read_rate(loader, args.tokens)
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
            first = warm_up(loader, 2, args.warmup_tokens)
            wait = training_loop_wait(loader, args.step_ms / 1000)
        finally:
            loader.close()
        print(f"{label:<30} {first:>13.3f} {wait * 1000:>16.2f}")


if __name__ == "__main__":
    main()
    # A closed lane's worker pipeline can leave requests in a multiprocessing queue whose workers
    # are gone; Python's exit would wait for them forever (Queue._finalize_join, seen on a loaded
    # machine). Everything is printed and flushed: end without the interpreter's teardown, as the
    # trainer's ranks do.
    from trainer.launch.process_exit import exit_without_teardown

    exit_without_teardown(0)
