"""Tokenize a text corpus once into token shards (format: trainer.data.shards).

    python -m trainer.data.prepare --input /data/corpus --tokenizer tok.model --output /data/corpus-shards

Every input file becomes one shard per split, tokenized by a pool of worker processes (one file
each at a time, largest first). Each document goes to the validation split when the hash of its
text falls below --validation-fraction, so adding files never moves a document between splits.
A file's shards and its record (`parts/<name>.json`) are written when the file is done; running
the same command again skips the files already done (a source file that changed is tokenized
again) and writes the manifest, which marks the folder complete, last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from trainer.data.documents import DataError, ReadCounts, find_data_files, read_file
from trainer.data.hashing import document_unit
from trainer.data.shards import FORMAT, MANIFEST, SPLITS, VERSION, manifest_digest, shard_paths, token_dtype
from trainer.data.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

ENCODE_BATCH = 512  # documents per SentencePiece call


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(path: str) -> str:
    """A file's shard name: readable, and unique through a hash of its absolute path."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).name)[:80]
    return f"{stem}-{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]}"


class _SplitWriter:
    """Appends documents' tokens to one shard file (under a temporary name until finished)."""

    def __init__(self, tokens_path: Path, dtype: np.dtype):
        self.final, self.dtype = tokens_path, dtype
        self.temporary = tokens_path.with_name(tokens_path.name + ".partial")
        self.file = open(self.temporary, "wb")
        self.starts: list[int] = [0]

    def add(self, ids: list[int]) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self.file)
        self.starts.append(self.starts[-1] + len(ids))

    def finish(self, docs_path: Path) -> dict:
        self.file.close()
        np.save(docs_path, np.asarray(self.starts, dtype=np.int64))
        os.replace(self.temporary, self.final)
        return {"documents": len(self.starts) - 1, "tokens": self.starts[-1]}


_tokenizer: Tokenizer | None = None


def _load_tokenizer(path: str) -> None:
    global _tokenizer
    _tokenizer = Tokenizer(path)


def prepare_file(task: dict) -> dict:
    """Tokenize one source file into its shards; returns the file's record (worker process)."""
    path, output, name = task["path"], Path(task["output"]), task["name"]
    started = time.perf_counter()
    dtype = np.dtype(task["dtype"])
    writers = {split: _SplitWriter(shard_paths(output, split, name)[0], dtype) for split in SPLITS}
    counts, batch = ReadCounts(), []

    def flush():
        for text, ids in zip(batch, _tokenizer.encode_batch_documents(batch, task["encode_threads"])):
            split = "validation" if document_unit(text) < task["validation_fraction"] else "train"
            writers[split].add(ids)
        batch.clear()

    for text in read_file(path, task["text_field"], counts):
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            flush()
    flush()
    record = {
        "name": name, "path": os.path.abspath(path), "size": os.path.getsize(path), "sha256": file_sha256(path),
        "skipped_records": counts.skipped.get(path, 0), "settings": task["settings"],
        "splits": {split: writers[split].finish(shard_paths(output, split, name)[1]) for split in SPLITS},
        "seconds": round(time.perf_counter() - started, 3),
    }
    part = output / "parts" / f"{name}.json"
    part.with_suffix(".partial").write_text(json.dumps(record, indent=1))
    os.replace(part.with_suffix(".partial"), part)
    return record


def _done_record(output: Path, name: str, path: str, settings: dict) -> dict | None:
    """The record of a file prepared by an earlier run with the same settings and content."""
    part = output / "parts" / f"{name}.json"
    if not part.is_file():
        return None
    record = json.loads(part.read_text())
    if record.get("settings") != settings or record.get("size") != os.path.getsize(path):
        return None
    if any(not p.is_file() for split in SPLITS for p in shard_paths(output, split, name)):
        return None
    if record["sha256"] != file_sha256(path):
        return None
    return record


def _check_output(output: Path, settings: dict, overwrite: bool) -> None:
    """Refuse to mix settings in one folder: shards of another tokenizer, split or text field
    would silently join the corpus."""
    manifest = output / MANIFEST
    if not manifest.is_file() or overwrite:
        return
    earlier = json.loads(manifest.read_text()).get("settings")
    if earlier != settings:
        changed = sorted(k for k in set(settings) | set(earlier or {}) if (earlier or {}).get(k) != settings.get(k))
        raise DataError(f"--output: {output} holds shards prepared with other settings ({', '.join(changed)}); "
                        "choose another --output, or pass --overwrite to prepare them again")


def prepare(inputs: list[str], tokenizer_path: str, output: str, *, text_field: str = "text",
            validation_fraction: float = 0.05, workers: int = 1, encode_threads: int = 1,
            overwrite: bool = False) -> dict:
    """Prepare (or complete) a shard folder; returns its manifest."""
    if not 0 <= validation_fraction < 1:
        raise DataError(f"--validation-fraction: {validation_fraction} is not in [0, 1)")
    tokenizer = Tokenizer(tokenizer_path)
    files = sorted({f for path in inputs for f in find_data_files(path, key="--input")})
    out = Path(output)
    settings = {"tokenizer_sha256": tokenizer.sha256, "text_field": text_field, "validation_fraction": validation_fraction,
                "dtype": token_dtype(tokenizer.vocab_size).str}
    _check_output(out, settings, overwrite)
    for folder in (*SPLITS, "parts"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    names = {path: shard_name(path) for path in files}
    records = {} if overwrite else {path: r for path in files if (r := _done_record(out, names[path], path, settings))}
    todo = sorted((p for p in files if p not in records), key=os.path.getsize, reverse=True)
    logger.info("%d files: %d prepared earlier, %d to tokenize with %d workers", len(files), len(records), len(todo), workers)
    tasks = [{"path": p, "output": str(out), "name": names[p], "dtype": settings["dtype"], "text_field": text_field,
              "validation_fraction": validation_fraction, "settings": settings, "encode_threads": encode_threads}
             for p in todo]
    with ProcessPoolExecutor(max_workers=max(1, workers), initializer=_load_tokenizer,
                             initargs=(tokenizer_path,)) as pool:
        for path, record in zip(todo, pool.map(prepare_file, tasks)):
            records[path] = record
            logger.info("%s: %d documents, %d tokens in %.1f s", record["path"], sum(
                s["documents"] for s in record["splits"].values()), sum(s["tokens"] for s in record["splits"].values()),
                record["seconds"])
    return _write_manifest(out, tokenizer, settings, [records[p] for p in files])


def _write_manifest(out: Path, tokenizer: Tokenizer, settings: dict, sources: list[dict]) -> dict:
    manifest = {
        "format": FORMAT, "version": VERSION, "settings": settings, "dtype": settings["dtype"],
        "tokenizer": {"file": os.path.abspath(tokenizer.path), "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "tokenizer_sha256": tokenizer.sha256, "validation_fraction": settings["validation_fraction"],
        "text_field": settings["text_field"],
        "sources": [{k: r[k] for k in ("name", "path", "size", "sha256", "skipped_records", "splits")} for r in sources],
        "totals": {split: {k: sum(r["splits"][split][k] for r in sources) for k in ("documents", "tokens")}
                   for split in SPLITS},
        "skipped_records": sum(r["skipped_records"] for r in sources),
    }
    manifest["digest"] = manifest_digest(manifest)
    (out / (MANIFEST + ".partial")).write_text(json.dumps(manifest, indent=1))
    os.replace(out / (MANIFEST + ".partial"), out / MANIFEST)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="data files, folders or globs (.jsonl/.json/.parquet/.txt, optionally .gz/.bz2/.xz/.zst)")
    parser.add_argument("--tokenizer", required=True, help="SentencePiece model (.model)")
    parser.add_argument("--output", required=True, help="folder for the shards and manifest.json")
    parser.add_argument("--text-field", default="text", help="field of .jsonl/.json/.parquet records (default: text)")
    parser.add_argument("--validation-fraction", type=float, default=0.05,
                        help="share of documents held out for validation, chosen by a hash of their text (default 0.05)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    parser.add_argument("--encode-threads", type=int, default=1,
                        help="SentencePiece threads per worker (default 1: the workers use the cores; -1: all cores)")
    parser.add_argument("--overwrite", action="store_true", help="prepare every file again, whatever the folder holds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    try:
        manifest = prepare(args.input, args.tokenizer, args.output, text_field=args.text_field,
                           validation_fraction=args.validation_fraction, workers=args.workers,
                           encode_threads=args.encode_threads, overwrite=args.overwrite)
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    totals = manifest["totals"]
    print(f"wrote {args.output}: {len(manifest['sources'])} files; train {totals['train']['documents']} documents, "
          f"{totals['train']['tokens']} tokens; validation {totals['validation']['documents']} documents, "
          f"{totals['validation']['tokens']} tokens; {manifest['skipped_records']} records skipped; {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
