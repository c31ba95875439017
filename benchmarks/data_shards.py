"""Pre-tokenized shards at corpus scale: start-up, memory and throughput of reading them, and the
speed of preparing them.

    python benchmarks/data_shards.py [--sizes-gb 1 10] [--folder /tmp/shard-bench] [--text-mb 40]

1. Shard sets of the given sizes in GB of text-equivalent (4 bytes of text per token, the usual
   ratio of English under a 32k-128k BPE vocabulary) are generated directly as uint16 tokens
   with documents of random length (mean 600 tokens): 1 GB is 250M tokens, 500 MB of shards.
   For each, a fresh process opens the training split with shuffling, builds the loader of a
   real job (sequences of 2048, global batch 64, DP rank 0 of 8) and reads 200 global batches;
   the table gives the time to open the set, to the first batch, the process's resident memory
   growth (RSS after 201 batches minus before opening) and the loader's tokens/s (DP rank 0's
   rows, 8 x 2048 tokens per batch).
2. Preparing: a generated jsonl corpus of --text-mb MB in 4 files is tokenized with 1 worker
   process and one per core, each encoding with 1 SentencePiece thread or all cores (tokens/s
   of the whole command); the same text as one file, as one part and cut into 8 ranges; and one
   process's batch encode, 1 thread against all cores.

Generated data is kept under --folder (removed with --clean); a size already generated is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.data.shards import FORMAT, MANIFEST, VERSION, manifest_digest  # noqa: E402

TOKENS_PER_GB_OF_TEXT = 250_000_000
SHARD_TOKENS = 100_000_000  # 200 MB shard files
VOCAB = 2048  # the debug model's, so that the trainer can run on the generated sets


def generate_shards(folder: Path, gigabytes: float) -> Path:
    """A prepared-looking folder of random tokens (train split only; a tiny validation split)."""
    out = folder / f"{gigabytes:g}gb"
    if (out / MANIFEST).is_file():
        return out
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "validation").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    total = int(gigabytes * TOKENS_PER_GB_OF_TEXT)
    sources = []
    for index, start in enumerate(range(0, total, SHARD_TOKENS)):
        count = min(SHARD_TOKENS, total - start)
        name = f"bench-{index:05d}"
        tokens = rng.integers(3, VOCAB, size=count, dtype=np.uint16)
        lengths = rng.geometric(1 / 600, size=count // 300 + 1)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        starts = np.concatenate([starts[starts < count], [count]]).astype(np.int64)
        tokens[starts[1:-1] - 1], tokens[starts[:-1]] = 2, 1  # EOS ends and BOS begins each document
        tokens.tofile(out / "train" / f"{name}.tokens")
        np.save(out / "train" / f"{name}.docs.npy", starts)
        validation = rng.integers(3, VOCAB, size=10_000, dtype=np.uint16)
        validation.tofile(out / "validation" / f"{name}.tokens")
        np.save(out / "validation" / f"{name}.docs.npy", np.array([0, 10_000], dtype=np.int64))
        sources.append({"name": name, "path": f"generated-{index}", "size": count * 4, "sha256": f"{index:064x}",
                        "skipped_records": 0, "splits": {"train": {"documents": len(starts) - 1, "tokens": count},
                                                         "validation": {"documents": 1, "tokens": 10_000}}})
    settings = {"tokenizer_sha256": "0" * 64, "text_field": "text", "validation_fraction": 0.0, "dtype": "<u2"}
    manifest = {"format": FORMAT, "version": VERSION, "settings": settings, "dtype": "<u2",
                "tokenizer": {"file": "generated", "sha256": "0" * 64, "vocab_size": VOCAB, "bos_id": 1, "eos_id": 2},
                "tokenizer_sha256": "0" * 64, "validation_fraction": 0.0, "text_field": "text", "sources": sources,
                "totals": {split: {key: sum(r["splits"][split][key] for r in sources) for key in ("documents", "tokens")}
                           for split in ("train", "validation")}, "skipped_records": 0}
    manifest["digest"] = manifest_digest(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


READER = r"""
import json, resource, sys, time
import numpy as np, torch
from trainer.data.finite_sources import ShardSource
from trainer.data.loader import BatchLoader

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

before = rss_mb()
t0 = time.perf_counter()
source = ShardSource(sys.argv[1], "train", shuffle_seed=0)
loader = BatchLoader(source, seq_len=2048, global_batch_size=64, local_batch_size=8, dp_rank=0, dp_degree=8,
                     device=torch.device("cpu"))
opened = time.perf_counter()
loader.next_batch()
first = time.perf_counter()
tokens = 0
for _ in range(200):
    tokens += sum(inputs.numel() for inputs, _ in loader.next_batch())
done = time.perf_counter()
print(json.dumps({"tokens": source.token_count, "open_s": opened - t0, "first_batch_s": first - opened,
                  "rss_growth_mb": rss_mb() - before, "tokens_per_s": tokens / (done - first)}))
"""


def measure_reading(folder: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", READER, str(folder)], capture_output=True, text=True, check=True,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_preparing(folder: Path, text_mb: float) -> list[tuple[str, float]]:
    from common import generated_jsonl_corpus, generated_tokenizer
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import Tokenizer

    corpus = folder / f"text-{text_mb:g}mb"
    generated_jsonl_corpus(corpus, text_mb, [f"part-{index}.jsonl" for index in range(4)])
    tokenizer = generated_tokenizer(folder)
    rows = []
    cores = os.cpu_count() or 1
    for workers, threads in ((1, 1), (1, -1), (cores, 1), (cores, -1)):
        started = time.perf_counter()
        manifest = prepare([str(corpus)], str(tokenizer), str(folder / "prepared"), workers=workers,
                           encode_threads=threads, overwrite=True)
        seconds = time.perf_counter() - started
        tokens = sum(manifest["totals"][s]["tokens"] for s in ("train", "validation"))
        label = "threads on all cores" if threads == -1 else "1 thread"
        rows.append((f"prepare ({text_mb:g} MB jsonl): {workers} worker{'s' if workers > 1 else ''} x {label}",
                     tokens / seconds))
    rows += measure_one_large_file(folder, corpus, tokenizer, text_mb, cores)
    model = Tokenizer(str(tokenizer))
    batch = [json.loads(line)["text"] for line in open(corpus / "part-0.jsonl")][:4000]
    for threads, label in ((1, "1 thread"), (-1, "all cores")):
        started = time.perf_counter()
        tokens = sum(len(ids) for ids in model.encode_batch_documents(batch, num_threads=threads))
        rows.append((f"one process, SentencePiece batch encode, {label}", tokens / (time.perf_counter() - started)))
    return rows


def measure_one_large_file(folder: Path, corpus: Path, tokenizer: Path, text_mb: float, cores: int):
    """The same text as one .jsonl file, prepared with one worker per core: as one part, and cut
    into 8 ranges (prepare.RANGE_BYTES lowered to an eighth of the file, as 256 MiB is for larger files)."""
    import trainer.data.prepare as prepare_module

    single = folder / f"single-{text_mb:g}mb" / "all.jsonl"
    if not single.is_file():
        single.parent.mkdir(parents=True, exist_ok=True)
        with open(single, "wb") as out:
            for part in sorted(corpus.glob("part-*.jsonl")):
                out.write(part.read_bytes())
    rows, default = [], prepare_module.RANGE_BYTES
    for label, range_bytes in (("one part", single.stat().st_size + 1), ("8 ranges", single.stat().st_size // 8 + 1)):
        prepare_module.RANGE_BYTES = range_bytes
        try:
            started = time.perf_counter()
            manifest = prepare_module.prepare([str(single)], str(tokenizer), str(folder / f"prepared-{label[0]}"),
                                              workers=cores, overwrite=True)
        finally:
            prepare_module.RANGE_BYTES = default
        tokens = sum(manifest["totals"][s]["tokens"] for s in ("train", "validation"))
        rows.append((f"prepare (one {text_mb:g} MB jsonl file, {cores} workers): {label}",
                     tokens / (time.perf_counter() - started)))
    return rows


def measure_trainer_start(shards: Path | None) -> float:
    """Wall seconds of a 2-process, 2-step debug-model run (start-up included)."""
    data = ["--training.dataset", "shards", "--training.dataset_path", str(shards)] if shards else []
    with tempfile.TemporaryDirectory() as dump:
        started = time.perf_counter()
        subprocess.run(["./torchrun_launch.sh", "--training.steps", "2", "--metrics.no_enable_tensorboard",
                        "--job.dump_folder", dump, *data], check=True, cwd=REPO, capture_output=True,
                       env=dict(os.environ, NGPU="2", PYTHON=sys.executable))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 10])
    parser.add_argument("--folder", default="/tmp/shard-bench")
    parser.add_argument("--text-mb", type=float, default=40)
    parser.add_argument("--clean", action="store_true", help="remove the generated data at the end")
    args = parser.parse_args()
    folder = Path(args.folder)
    print(f"{'shard set':>20} {'tokens':>14} {'files GB':>9} {'generate s':>10} {'open s':>8} {'first batch s':>13} "
          f"{'RSS growth MB':>13} {'loader tok/s':>13}")
    for size in args.sizes_gb:
        started = time.perf_counter()
        out = generate_shards(folder, size)
        generated = time.perf_counter() - started
        files_gb = sum(p.stat().st_size for p in (out / "train").glob("*.tokens")) / 1e9
        m = measure_reading(out)
        print(f"{f'{size:g} GB text-equiv.':>20} {m['tokens']:>14,} {files_gb:>9.2f} {generated:>10.1f} "
              f"{m['open_s']:>8.3f} {m['first_batch_s']:>13.4f} {m['rss_growth_mb']:>13.1f} {m['tokens_per_s']:>13,.0f}")
    print()
    print(f"{'trainer, 2 processes, debug model, 2 steps':<55} {'wall s':>12}")
    print(f"{'synthetic data':<55} {measure_trainer_start(None):>12.1f}")
    largest = folder / f"{max(args.sizes_gb):g}gb"
    print(f"{f'{max(args.sizes_gb):g} GB text-equivalent shards':<55} {measure_trainer_start(largest):>12.1f}")
    print()
    print(f"{'tokenizing':<55} {'tokens/s':>12}")
    for label, rate in measure_preparing(folder, args.text_mb):
        print(f"{label:<55} {rate:>12,.0f}")
    if args.clean:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
