"""The built-in real-text corpus `training.dataset = "python_stdlib"`: the installed Python's own
standard library, prepared once into token shards in a cache folder.

The documents are the language reference prose of `pydoc_data.topics` (one per topic, by name)
and the source of the standard library's single-file top-level modules (`<stdlib>/*.py`, one per
file, by name; no packages, no site-packages). Every machine running the trainer has them (the
trainer runs in that Python), they are real text written by people, and code has long-range
structure (names defined early and used later, indentation), so attention and positions matter.

Their content depends on the Python version, so the corpus is identified by a SHA-256 over the
Python version and every document's name and text; that digest, the tokenizer (trained here, or
the job's own, by its SHA-256) and the held-out fraction name the cache folder:

    <cache>/python_stdlib/py<version>-<digest>-<vocab<N> | tok-<sha256>>-heldout<fraction>/
        corpus.jsonl     the documents, one {"name", "text"} object a line
        tokenizer/       the byte-level BPE trained on it (absent with the job's own tokenizer)
        shards/          trainer.data.prepare's folder: both splits and manifest.json
        corpus.json      what the folder holds (written last)

<cache> is $TRAINER_CACHE_DIR, else $XDG_CACHE_HOME/llama_pretrain, else ~/.cache/llama_pretrain.
A folder is written under a temporary name and renamed into place when complete, while holding
an flock on `<folder>.lock`: processes starting together (the ranks of a run started without the
launcher, several runs of a plan) prepare it once, the others wait and reuse it, and a killed
preparation leaves only a temporary folder, removed by the next one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.data.documents import DataError
from trainer.data.shards import SPLITS, ShardSet, read_manifest
from trainer.records.safe_writes import LinkRefused, open_no_follow

logger = logging.getLogger(__name__)

NAME = "python_stdlib"
MAX_VOCAB = 8192  # the trained tokenizer's size when the model's vocabulary is larger
CACHE_ENV = "TRAINER_CACHE_DIR"
RECORD = "corpus.json"
FORMAT_VERSION = 1  # of the cache folder's layout: a new layout gets new folders


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class PreparedCorpus:
    folder: Path
    identity: dict  # python, documents, bytes, sha256
    manifest: dict  # of the shards

    @property
    def shards(self) -> Path:
        return self.folder / "shards"


def stdlib_modules() -> list[Path]:
    """The standard library's top-level modules, by name. sysconfig's "stdlib" is the base
    installation's library also inside a virtualenv, and holds no site-packages at its top."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in folder.glob("*.py") if p.is_file() and not p.name.startswith("test_")),
                  key=lambda p: p.name)


def reference_topics() -> dict[str, str]:
    """pydoc_data.topics: the language reference's prose by topic, as help() shows it. Some
    distributions leave the module out; the corpus is then the modules alone (its digest says so)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return {}
    return dict(topics)


def documents() -> list[Document]:
    """Every document of the corpus, in a fixed order: topics by name, then modules by name.
    A module that is not UTF-8 (none is in CPython 3.11) is read with replacement characters."""
    topics = reference_topics()
    docs = [Document(f"pydoc_data.topics/{name}", topics[name]) for name in sorted(topics)]
    docs += [Document(path.name, path.read_bytes().decode("utf-8", errors="replace")) for path in stdlib_modules()]
    return docs


def python_version() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}"


def identity(docs: list[Document]) -> dict:
    """What the corpus is: the Python version, the document count and size, and a SHA-256 over
    the version and every document's name and text (each length-prefixed, so that no two
    corpora hash alike by moving text between documents)."""
    digest = hashlib.sha256(f"{NAME} {python_version()}\n".encode())
    size = 0
    for doc in docs:
        name, text = doc.name.encode(), doc.text.encode("utf-8", "surrogatepass")
        digest.update(b"%d:%s%d:" % (len(name), name, len(text)))
        digest.update(text)
        size += len(text)
    return {"python": python_version(), "documents": len(docs), "bytes": size, "sha256": digest.hexdigest()}


def cache_root() -> Path:
    """$TRAINER_CACHE_DIR, else $XDG_CACHE_HOME/llama_pretrain, else ~/.cache/llama_pretrain."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama_pretrain"


def tokenizer_vocab(model_vocab_size: int) -> int:
    """A corpus of 5 MB gains little from more pieces, and the model may have fewer ids."""
    return min(model_vocab_size, MAX_VOCAB)


def folder_name(corpus: dict, vocab_size: int, tokenizer_sha256: str | None, validation_fraction: float) -> str:
    version = corpus["python"].split()[-1]
    made_with = f"tok-{tokenizer_sha256[:16]}" if tokenizer_sha256 else f"vocab{vocab_size}"
    return f"py{version}-{corpus['sha256'][:16]}-{made_with}-heldout{validation_fraction:g}-v{FORMAT_VERSION}"


def ensure_prepared(model_vocab_size: int, *, tokenizer=None, validation_fraction: float = 0.05,
                    say: Callable[[str], None] = logger.info) -> PreparedCorpus:
    """The prepared corpus for a model of `model_vocab_size` ids, prepared now if no process has
    yet. tokenizer: the job's own (trainer.data.tokenizer.Tokenizer), or None to train one of
    tokenizer_vocab(model_vocab_size) pieces. say: where the one line about preparing goes."""
    docs = documents()
    corpus = identity(docs)
    sha = tokenizer.sha256 if tokenizer is not None else None
    vocab = tokenizer_vocab(model_vocab_size)
    root = cache_root() / NAME
    final = root / folder_name(corpus, vocab, sha, validation_fraction)
    found = _complete(final, corpus)
    if found:
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(final.with_name(final.name + ".lock"), final, say):
            found = _complete(final, corpus)  # another process may have prepared it while this one waited
            if found:
                return found
            _clear_leftovers(final)
            return _prepare(final, docs, corpus, vocab, tokenizer, validation_fraction, say)
    except (OSError, LinkRefused) as e:
        raise DataError(f"training.dataset: cannot prepare the {NAME} corpus in {root} ({e}); set {CACHE_ENV} "
                        "to a folder this user can write") from None


def _complete(folder: Path, corpus: dict) -> PreparedCorpus | None:
    """The prepared corpus in `folder` when it is whole: its record names this corpus and its
    shards open (the manifest and every shard's size). A folder renamed into place is whole
    unless damaged since; a damaged one is prepared again."""
    record_path = folder / RECORD
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_bytes())
        if record.get("corpus") != corpus:
            raise DataError(f"{record_path} describes another corpus")
        manifest = read_manifest(folder / "shards", "training.dataset")
        for split in SPLITS:
            ShardSet(folder / "shards", split, "training.dataset").close()
    except (OSError, ValueError, AttributeError, DataError) as e:
        logger.warning("%s: the prepared %s corpus there is damaged (%s); preparing it again", folder, NAME, e)
        return None
    return PreparedCorpus(folder, corpus, manifest)


class _locked:
    """An exclusive flock on `path` for the `with` block, waiting (and saying so) while another
    process holds it. The kernel drops it when its holder dies, however it dies."""

    def __init__(self, path: Path, folder: Path, say: Callable[[str], None]):
        self.path, self.folder, self.say = path, folder, say

    def __enter__(self):
        self.fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.say(f"waiting for another process preparing the {NAME} corpus into {self.folder}")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the flock; the file stays, for the next process to lock


def _clear_leftovers(final: Path) -> None:
    """Under the lock: temporary folders of preparations that died (the lock's holder is this
    process, so nobody writes them), and a damaged folder under the final name."""
    for partial in final.parent.glob(final.name + ".partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)


def _prepare(final: Path, docs: list[Document], corpus: dict, vocab: int, tokenizer, validation_fraction: float,
             say: Callable[[str], None]) -> PreparedCorpus:
    """Write the corpus, train its tokenizer and tokenize it into a temporary folder, then rename
    it into place: the final name appears only when everything is written."""
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import train_hf_tokenizer

    say(f"preparing the {NAME} corpus ({corpus['documents']} documents, {corpus['bytes'] / 1e6:.1f} MB) once into "
        f"{final}")
    started = time.perf_counter()
    work = final.with_name(f"{final.name}.partial-{os.getpid()}")
    work.mkdir()
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"name": doc.name, "text": doc.text}) + "\n")
    if tokenizer is None:
        tokenizer_path = str(train_hf_tokenizer([str(work / "corpus.jsonl")], str(work / "tokenizer"), vocab))
    else:
        tokenizer_path = tokenizer.path
    manifest = prepare([str(work / "corpus.jsonl")], tokenizer_path, str(work / "shards"),
                       validation_fraction=validation_fraction, workers=1)
    manifest = _relocate(work / "shards", work, final)
    seconds = time.perf_counter() - started
    record = {"corpus": corpus, "names": [doc.name for doc in docs], "tokenizer": manifest["tokenizer"],
              "validation_fraction": validation_fraction, "totals": manifest["totals"],
              "seconds": round(seconds, 2)}
    (work / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    os.rename(work, final)
    totals = manifest["totals"]
    say(f"prepared the {NAME} corpus in {seconds:.1f} s: train {totals['train']['tokens']:,} tokens, validation "
        f"{totals['validation']['tokens']:,} tokens ({manifest['tokenizer']['vocab_size']} pieces)")
    return PreparedCorpus(final, corpus, manifest)


def _relocate(shards: Path, work: Path, final: Path) -> dict:
    """The manifest names its files by absolute path; name them where the folder will be. Its
    digest covers the content only, so it stays the same."""
    path = shards / "manifest.json"
    manifest = json.loads(path.read_text())
    old, new = os.path.abspath(work), os.path.abspath(final)  # as prepare wrote them

    def moved(value: str) -> str:
        return new + value[len(old):] if value.startswith(old + os.sep) else value

    manifest["tokenizer"]["file"] = moved(manifest["tokenizer"]["file"])
    for source in manifest["sources"]:
        source["path"] = moved(source["path"])
    path.with_suffix(".partial").write_text(json.dumps(manifest, indent=1))
    os.replace(path.with_suffix(".partial"), path)
    return manifest
