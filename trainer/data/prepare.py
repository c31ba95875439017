"""Tokenize a text corpus once into token shards (format: trainer.data.shards).

    python -m trainer.data.prepare --input /data/corpus --tokenizer tok.model --output /data/corpus-shards
    python -m trainer.data.prepare --dataset fineweb-edu --tokenizer tok.model --output /data/fineweb-shards

Every input file becomes one part (one shard per split), tokenized by a pool of worker processes
(one part each at a time, largest first); an uncompressed .jsonl file larger than RANGE_BYTES
(256 MiB) is cut at line starts into parts of about that size, so that one huge file keeps every
worker busy. A Hugging Face dataset is streamed, its data files split into one part per worker. Each document goes to the validation split when the hash of its
text falls below --validation-fraction, so adding files never moves a document between splits.
A part's shards and its record (`parts/<name>.json`) are written when the part is done; running
the same command again skips the parts already done (a source file that changed is tokenized
again; a dataset's parts are kept as they are, --overwrite prepares them again) and writes the
manifest, which marks the folder complete, last.
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
from typing import Iterator

import numpy as np

from trainer import messages
from trainer.data.documents import (FIELD_KEY, DataError, ReadCounts, file_format, find_data_files, line_start,
                                    read_file, read_jsonl_range, record_text)
from trainer.data.hashing import document_unit
from trainer.data.shards import (FORMAT, MANIFEST, SPLITS, VERSION, manifest_digest, shard_paths, splits_problem,
                                  token_dtype)
from trainer.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)

ENCODE_BATCH = 512  # documents per tokenizer call
RANGE_BYTES = 256 << 20  # an uncompressed .jsonl file is cut into parts of about this size


def range_sha256(path: str, start: int, stop: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        remaining = stop - start
        while remaining > 0:
            block = f.read(min(1 << 22, remaining))
            if not block:
                break
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


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
    _tokenizer = load_tokenizer(path, "--tokenizer", say_added=False)  # the parent process said it


def stream_part_name(dataset: str, split: str, index: int, count: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', dataset)}-{split}-{index:05d}-of-{count:05d}"


def _stream_texts(task: dict, counts: ReadCounts, digest) -> Iterator[str]:
    """The documents of one part of a Hugging Face dataset (its data files are split among the
    parts), hashing their text as they pass: the part's identity."""
    from trainer.data.text_sources import hub_stream_opener

    stream = hub_stream_opener(task["dataset"], task["dataset_path"], task["split"])()
    where = f"{task['dataset']}:{task['split']} part {task['index']}"
    for number, record in enumerate(stream.shard(num_shards=task["count"], index=task["index"]), 1):
        text = record_text(record, task["text_field"], f"{where} record {number}", counts, where)
        if text is not None:
            digest.update(text.encode("utf-8", "surrogatepass"))
            counts.documents += 1
            yield text


def _source_identity(task: dict, counts: ReadCounts, digest) -> dict:
    if "dataset" in task:
        where = f"{task['dataset']}:{task['split']} part {task['index']}"
        return {"path": f"hf:{task['dataset']}" + (f" ({task['dataset_path']})" if task["dataset_path"] else ""),
                "size": counts.documents, "sha256": digest.hexdigest(), "skipped_records": counts.skipped.get(where, 0)}
    path = task["path"]
    identity = _file_identity(task)
    return {"path": os.path.abspath(path), **identity, "skipped_records": counts.skipped.get(path, 0)}


def _file_identity(task: dict) -> dict:
    """Size and SHA-256 of a task's file, or of its byte range (with the range)."""
    path = task["path"]
    if "range" not in task:
        return {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    start, stop = task["range"]
    return {"range": [start, stop], "size": stop - start, "sha256": range_sha256(path, start, stop)}


def prepare_file(task: dict) -> dict:
    """Tokenize one part (a source file, or a part of a dataset's stream) into its shards;
    returns its record (worker process)."""
    output, name = Path(task["output"]), task["name"]
    started = time.perf_counter()
    dtype = np.dtype(task["dtype"])
    writers = {split: _SplitWriter(shard_paths(output, split, name)[0], dtype) for split in SPLITS}
    counts, batch = ReadCounts(), []

    def flush():
        for text, ids in zip(batch, _tokenizer.encode_batch_documents(batch, task["encode_threads"])):
            split = "validation" if document_unit(text) < task["validation_fraction"] else "train"
            writers[split].add(ids)
        batch.clear()

    digest = hashlib.sha256()
    if "dataset" in task:
        texts = _stream_texts(task, counts, digest)
    elif "range" in task:
        texts = read_jsonl_range(task["path"], *task["range"], task["text_field"], counts)
    else:
        texts = read_file(task["path"], task["text_field"], counts)
    for text in texts:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            flush()
    flush()
    record = {
        "name": name, **_source_identity(task, counts, digest), "settings": task["settings"],
        "splits": {split: writers[split].finish(shard_paths(output, split, name)[1]) for split in SPLITS},
        "seconds": round(time.perf_counter() - started, 3),
    }
    part = output / "parts" / f"{name}.json"
    part.with_suffix(".partial").write_text(json.dumps(record, indent=1))
    os.replace(part.with_suffix(".partial"), part)
    return record


def _done_record(output: Path, task: dict, settings: dict) -> dict | None:
    """The record of a part prepared by an earlier run with the same settings (and, for a file or
    a range of one, the same content; a dataset's part cannot be checked without reading it again)."""
    name, path = task["name"], task.get("path")
    part = output / "parts" / f"{name}.json"
    if not part.is_file():
        return None
    record = _read_json(part)
    if not isinstance(record, dict) or record.get("settings") != settings:
        return None
    skipped = record.get("skipped_records")
    if (record.get("name") != name or not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0
            or splits_problem(record.get("splits"), "splits")
            or not _shards_match(output, name, record["splits"], settings["dtype"])):
        logger.warning("%s does not match its shards (damaged, or not written by this command): preparing %s again",
                       part, name)
        return None
    if path is None:
        return record
    size = task["range"][1] - task["range"][0] if "range" in task else os.path.getsize(path)
    if record.get("size") != size or record.get("range") != task.get("range"):
        return None
    if record.get("sha256") != _file_identity(task)["sha256"]:
        return None
    return record


def _shards_match(output: Path, name: str, splits: dict, dtype: str) -> bool:
    """Whether a part's shards are on disk, its token files of the size its record says."""
    for split in SPLITS:
        tokens, docs = shard_paths(output, split, name)
        expected = splits[split]["tokens"] * np.dtype(dtype).itemsize
        if not (tokens.is_file() and docs.is_file()) or tokens.stat().st_size != expected:
            return False
    return True


def _read_json(path: Path):
    """A file's JSON, or None when it is not readable JSON (the caller prepares again or refuses)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def _check_output(output: Path, settings: dict, overwrite: bool) -> None:
    """Refuse to mix settings in one folder: shards of another tokenizer, split or text field
    would silently join the corpus."""
    manifest = output / MANIFEST
    if not manifest.is_file() or overwrite:
        return
    earlier = _read_json(manifest)
    earlier = earlier.get("settings") if isinstance(earlier, dict) else None
    if not isinstance(earlier, dict):
        raise DataError(f"--output: {manifest} is not the manifest of a prepared folder (unreadable, or without "
                        "settings); choose another --output, or pass --overwrite to prepare the folder again")
    if earlier != settings:
        # Only this version's own keys are named: the manifest's other keys come from a file and
        # may be anything (a key of a megabyte would make the message one).
        changed = [k for k in sorted(settings) if earlier.get(k) != settings[k]]
        unknown = len(set(earlier) - set(settings))
        if unknown:
            changed.append(f"{unknown} setting{'s' if unknown > 1 else ''} this version does not know")
        raise DataError(f"--output: {output} holds shards prepared with other settings ({', '.join(changed)}); "
                        "choose another --output, or pass --overwrite to prepare them again")


def prepare(inputs: list[str], tokenizer_path: str, output: str, *, text_field: str = "text",
            validation_fraction: float = 0.05, workers: int = 1, encode_threads: int = 1,
            overwrite: bool = False, dataset: str = "", dataset_path: str = "", split: str = "train") -> dict:
    """Prepare (or complete) a shard folder from local files (`inputs`) or a Hugging Face
    dataset (`dataset`, read from `dataset_path` when given); returns its manifest."""
    if not 0 <= validation_fraction < 1:
        raise DataError(f"--validation-fraction: {validation_fraction} is not in [0, 1)")
    if bool(inputs) == bool(dataset):
        raise DataError("give either --input (local files) or --dataset (a Hugging Face dataset)")
    tokenizer = load_tokenizer(tokenizer_path, "--tokenizer")
    out = Path(output)
    settings = {"tokenizer_sha256": tokenizer.sha256, "text_field": text_field, "validation_fraction": validation_fraction,
                "dtype": token_dtype(tokenizer.vocab_size).str}
    _check_output(out, settings, overwrite)
    common = {"output": str(out), "dtype": settings["dtype"], "text_field": text_field, "settings": settings,
              "validation_fraction": validation_fraction, "encode_threads": encode_threads}
    tasks = (_dataset_tasks(dataset, dataset_path, split, workers) if dataset else _file_tasks(inputs))
    tasks = [{**task, **common} for task in tasks]
    for folder in (*SPLITS, "parts"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    records = {} if overwrite else {
        t["name"]: r for t in tasks if (r := _done_record(out, t, settings))}
    todo = [t for t in tasks if t["name"] not in records]
    _warn_of_stale_parts(out, {t["name"] for t in tasks})
    logger.info("%d parts: %d prepared earlier, %d to tokenize with %d workers", len(tasks), len(records), len(todo),
                workers)
    with ProcessPoolExecutor(max_workers=max(1, workers), initializer=_load_tokenizer,
                             initargs=(tokenizer_path,)) as pool:
        for task, record in zip(todo, pool.map(prepare_file, todo)):
            records[task["name"]] = record
            where = record["path"] + (" bytes %d-%d" % tuple(record["range"]) if "range" in record else "")
            logger.info("%s: %d documents, %d tokens in %.1f s", where, sum(
                s["documents"] for s in record["splits"].values()), sum(s["tokens"] for s in record["splits"].values()),
                record["seconds"])
    return _write_manifest(out, tokenizer, settings, [records[t["name"]] for t in sorted(tasks, key=lambda t: t["order"])])


def _warn_of_stale_parts(out: Path, current: set[str]) -> None:
    """Parts of inputs no longer given stay on disk (nothing prepared is deleted) but leave the
    manifest: say which, so that the user can remove them."""
    stale = sorted(p.stem for p in (out / "parts").glob("*.json") if p.stem not in current)
    if stale:
        logger.warning("%d parts in %s are not among the inputs and leave the manifest (their files stay; delete "
                       "them if unwanted): %s", len(stale), out, ", ".join(stale[:5]) + (" ..." if len(stale) > 5 else ""))


def _file_tasks(inputs: list[str]) -> list[dict]:
    """One part per file, or per range of a large .jsonl file; the largest first (they take
    longest), the manifest in path order."""
    files = sorted({f for path in inputs for f in find_data_files(path, key="--input")})
    tasks = []
    for order, path in enumerate(files):
        size = os.path.getsize(path)
        if file_format(path) != (".jsonl", "") or size <= RANGE_BYTES:
            tasks.append({"path": path, "name": shard_name(path), "order": (order, 0), "bytes": size})
            continue
        starts = sorted({line_start(path, offset) for offset in range(0, size, RANGE_BYTES)} - {size})
        for index, (start, stop) in enumerate(zip(starts, [*starts[1:], size])):
            tasks.append({"path": path, "range": [start, stop], "name": f"{shard_name(path)}-bytes-{index:05d}",
                          "order": (order, index), "bytes": stop - start})
    return sorted(tasks, key=lambda task: task["bytes"], reverse=True)


def _dataset_tasks(dataset: str, dataset_path: str, split: str, workers: int) -> list[dict]:
    """One part per worker, each reading its share of the dataset's data files."""
    from trainer.data.text_sources import hub_stream_opener

    files = hub_stream_opener(dataset, dataset_path, split)().n_shards
    count = max(1, min(workers, files))
    return [{"dataset": dataset, "dataset_path": dataset_path, "split": split, "index": index, "count": count,
             "name": stream_part_name(dataset, split, index, count), "order": index} for index in range(count)]


def _write_manifest(out: Path, tokenizer: Tokenizer, settings: dict, sources: list[dict]) -> dict:
    manifest = {
        "format": FORMAT, "version": VERSION, "settings": settings, "dtype": settings["dtype"],
        "tokenizer": {"file": os.path.abspath(tokenizer.path), "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "tokenizer_sha256": tokenizer.sha256, "validation_fraction": settings["validation_fraction"],
        "text_field": settings["text_field"],
        "sources": [{k: r[k] for k in ("name", "path", "range", "size", "sha256", "skipped_records", "splits") if k in r}
                    for r in sources],
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
    parser.add_argument("--input", nargs="+", default=[],
                        help="data files, folders or globs (.jsonl/.json/.parquet/.txt, optionally .gz/.bz2/.xz/.zst)")
    parser.add_argument("--dataset", default="", help="instead of --input: a Hugging Face dataset (hub id, or c4, "
                        "fineweb, fineweb-edu), streamed; its data files are split among the workers")
    parser.add_argument("--dataset-path", default="", help="with --dataset: a local copy (folder of data files)")
    parser.add_argument("--split", default="train", help="with --dataset: the split to read (default train)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer file: a Hugging Face tokenizer.json, a tiktoken "
                        "ranks file (Llama 3's tokenizer.model) or a SentencePiece .model")
    parser.add_argument("--output", required=True, help="folder for the shards and manifest.json")
    parser.add_argument("--text-field", default="text", help="field of .jsonl/.json/.parquet records (default: text)")
    parser.add_argument("--validation-fraction", type=float, default=0.05,
                        help="share of documents held out for validation, chosen by a hash of their text (default 0.05)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    parser.add_argument("--encode-threads", type=int, default=1,
                        help="tokenizer threads per worker (default 1: the workers use the cores; -1: all cores; a "
                             "Hugging Face tokenizer takes all cores whenever this is not 1)")
    parser.add_argument("--overwrite", action="store_true", help="prepare every file again, whatever the folder holds")
    args = parser.parse_args(argv)
    messages.configure()
    started = time.perf_counter()
    try:
        manifest = prepare(args.input, args.tokenizer, args.output, text_field=args.text_field,
                           validation_fraction=args.validation_fraction, workers=args.workers,
                           encode_threads=args.encode_threads, overwrite=args.overwrite, dataset=args.dataset,
                           dataset_path=args.dataset_path, split=args.split)
    except (DataError, TokenizerError) as e:
        print(f"error: {str(e).replace(FIELD_KEY, '--text-field')}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    totals = manifest["totals"]
    print(f"wrote {args.output}: {len(manifest['sources'])} parts; train {totals['train']['documents']} documents, "
          f"{totals['train']['tokens']} tokens; validation {totals['validation']['documents']} documents, "
          f"{totals['validation']['tokens']} tokens; {manifest['skipped_records']} records skipped; {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
