"""The built-in python_stdlib corpus (trainer/data/python_corpus.py): its documents and digest,
the cache folder it is prepared into once (reuse, concurrent preparers, killed preparations), its
tokenizer at the tiny model's 256 ids, its held-out split, and its place among the sources.

The real corpus is prepared once per module, at vocabulary 256, into a temporary cache (about 7
s on 2 cores); the tests of the cache's machinery prepare a subset of its documents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.launch import REPO
from trainer.config.manager import ConfigError, load_config
from trainer.data import python_corpus
from trainer.data.build import build_sources, document_eos, is_streamed, text_dataset
from trainer.data.hashing import document_unit
from trainer.data.shards import ShardSet
from trainer.data.tokenizer import load_tokenizer
from trainer.launch.launcher import hub_datasets
from trainer.preflight.data import check_data

JOB = ["--model.flavor", "tiny", "--training.dataset", "python_stdlib", "--training.seq_len", "64"]
SUBSET = 30  # documents of the subset the machinery tests prepare
SECONDS: dict[str, float] = {}  # the module's preparation of the real corpus, for the measured figures


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding the real corpus prepared at vocabulary 256; TRAINER_CACHE_DIR names it."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(python_corpus.CACHE_ENV, str(folder))
        started = time.perf_counter()
        prepared = python_corpus.ensure_prepared(256)
        SECONDS["prepare"] = time.perf_counter() - started
        yield prepared


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(python_corpus.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / python_corpus.NAME


def use_cache(monkeypatch, prepared) -> None:
    monkeypatch.setenv(python_corpus.CACHE_ENV, str(prepared.folder.parent.parent))


def subset(monkeypatch) -> list[python_corpus.Document]:
    docs = python_corpus.documents()[:SUBSET]
    monkeypatch.setattr(python_corpus, "documents", lambda: docs)
    return docs


def test_the_documents_and_their_digest_are_deterministic():
    docs = python_corpus.documents()
    assert docs == python_corpus.documents()
    names = [d.name for d in docs]
    topics = [n for n in names if n.startswith("pydoc_data.topics/")]
    modules = names[len(topics):]
    assert topics == sorted(topics) and len(topics) > 50  # the language reference (79 topics on 3.11)
    assert modules == sorted(modules) and all(n.endswith(".py") and "/" not in n for n in modules)
    assert {"os.py", "argparse.py", "typing.py"} <= set(modules) and "site-packages" not in "".join(modules)
    ident = python_corpus.identity(docs)
    assert ident == python_corpus.identity(python_corpus.documents())
    assert ident["documents"] == len(docs) and ident["python"].endswith(sys.version.split()[0])
    assert ident["bytes"] == sum(len(d.text.encode()) for d in docs) > 3_000_000
    edited = [*docs[:-1], python_corpus.Document(docs[-1].name, docs[-1].text + " ")]
    moved = [python_corpus.Document(docs[0].name, docs[0].text + docs[1].text[:1]),
             python_corpus.Document(docs[1].name, docs[1].text[1:]), *docs[2:]]
    renamed = [python_corpus.Document("other.py", docs[0].text), *docs[1:]]
    digests = {python_corpus.identity(d)["sha256"] for d in (docs, edited, moved, renamed, docs[:-1])}
    assert len(digests) == 5


def test_the_cache_folder_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(python_corpus.CACHE_ENV, raising=False)
    assert python_corpus.cache_root() == tmp_path / "home" / ".cache" / "llama_pretrain"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert python_corpus.cache_root() == tmp_path / "xdg" / "llama_pretrain"
    monkeypatch.setenv(python_corpus.CACHE_ENV, str(tmp_path / "mine"))
    assert python_corpus.cache_root() == tmp_path / "mine"
    assert [python_corpus.tokenizer_vocab(v) for v in (256, 2048, 128256)] == [256, 2048, 8192]


def test_the_real_corpus_is_prepared_once_and_reused_without_tokenizing(cache, monkeypatch, measured):
    ident, totals = cache.identity, cache.manifest["totals"]
    measured(f"python_stdlib at vocab 256: {ident['documents']} documents, {ident['bytes'] / 1e6:.2f} MB, prepared in "
             f"{SECONDS['prepare']:.1f} s; train {totals['train']['tokens']:,} tokens, validation "
             f"{totals['validation']['tokens']:,}")
    assert cache.folder.name.startswith(f"py{sys.version.split()[0]}-{ident['sha256'][:16]}-vocab256-heldout0.05")
    assert sorted(p.name for p in cache.folder.parent.iterdir()) == [cache.folder.name, cache.folder.name + ".lock"]
    assert json.loads((cache.folder / "corpus.json").read_text())["corpus"] == ident
    # Paths in the manifest name the final folder, not the temporary one it was written in.
    assert cache.manifest["tokenizer"]["file"] == os.path.join(os.path.abspath(cache.folder), "tokenizer",
                                                               "tokenizer.json")
    assert cache.manifest["sources"][0]["path"] == os.path.join(os.path.abspath(cache.folder), "corpus.jsonl")
    use_cache(monkeypatch, cache)

    def refuse(*args, **kwargs):
        raise AssertionError("a prepared corpus was prepared again")

    monkeypatch.setattr("trainer.data.prepare.prepare", refuse)
    monkeypatch.setattr("trainer.data.tokenizer.train_hf_tokenizer", refuse)
    said = []
    started = time.perf_counter()
    again = python_corpus.ensure_prepared(256, say=said.append)
    measured(f"python_stdlib: a prepared cache found in {time.perf_counter() - started:.3f} s")
    assert again.folder == cache.folder and again.manifest == cache.manifest and said == []


def test_its_tokenizer_has_256_ids_and_round_trips_all_but_unknown_bytes(cache):
    tokenizer = load_tokenizer(cache.manifest["tokenizer"]["file"])
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (256, 0, 1)
    assert tokenizer._tok.token_to_id("<unk>") == 2
    docs = python_corpus.documents()
    for doc in docs[::25]:
        assert tokenizer.decode(tokenizer.encode(doc.text)) == doc.text
    present = set("".join(d.text for d in docs).encode())
    absent = next(b for b in range(1, 128) if b not in present)  # a control character no document holds
    assert tokenizer.decode(tokenizer.encode(f"x = 1{chr(absent)}\n")) == "x = 1<unk>\n"


def test_the_validation_split_holds_the_held_out_documents_and_training_the_others(cache):
    """Each split is exactly its documents' [BOS] text [EOS], in corpus order: disjoint, and the
    held-out ones chosen by the hash of their text, as for every prepared corpus."""
    tokenizer = load_tokenizer(cache.manifest["tokenizer"]["file"])
    docs = python_corpus.documents()
    held_out = [document_unit(d.text) < 0.05 for d in docs]
    assert 0 < sum(held_out) < len(docs) / 5
    for split, wanted in (("validation", True), ("train", False)):
        texts = [d.text for d, h in zip(docs, held_out) if h == wanted]
        expected = np.concatenate([np.asarray(ids) for ids in tokenizer.encode_batch_documents(texts, 0)])
        shards = ShardSet(cache.folder / "shards", split)
        assert shards.manifest["totals"][split]["documents"] == len(texts)
        assert np.array_equal(shards.tokens(0, shards.token_count), expected)
        shards.close()


def test_the_source_is_named_and_fingerprinted_by_the_corpus_and_masks_documents(cache, monkeypatch):
    use_cache(monkeypatch, cache)
    config = load_config([*JOB, "--validation.enable", "--training.document_masking"])
    check_data(config)
    assert not is_streamed("python_stdlib") and text_dataset(config) == "" and hub_datasets(config) == []
    train, validation = build_sources(config, 256)
    assert (train.name, validation.name) == ("python_stdlib:train", "python_stdlib:validation")
    assert document_eos(config, train) == 1
    fingerprint = train.fingerprint()
    assert (fingerprint["corpus_sha256"], fingerprint["python"]) == (cache.identity["sha256"], cache.identity["python"])
    assert str(cache.folder) not in json.dumps(fingerprint)  # the same corpus wherever its cache is
    assert train.describe()["corpus_sha256"] == cache.identity["sha256"]
    rows = train.rows(0, 4, 65)
    assert rows.shape == (4, 65) and rows.max() < 256
    train.shards.close()
    validation.shards.close()


def test_dataset_path_is_refused_with_one_message(monkeypatch, tmp_path):
    monkeypatch.setenv(python_corpus.CACHE_ENV, str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        check_data(load_config([*JOB, "--training.dataset_path", "/data/corpus"]))
    assert str(refused.value) == ("training.dataset_path: '/data/corpus' is set but training.dataset is "
                                  "'python_stdlib', which is built in and reads no path; leave dataset_path empty, or "
                                  "set training.dataset to 'shards' or 'files' to read that path")
    assert not any(tmp_path.iterdir())  # the check writes nothing


def test_the_jobs_own_tokenizer_is_used_and_keys_the_folder(cache, own_cache, monkeypatch):
    docs = subset(monkeypatch)
    tokenizer = load_tokenizer(cache.manifest["tokenizer"]["file"])
    prepared = python_corpus.ensure_prepared(2048, tokenizer=tokenizer)
    assert f"-tok-{tokenizer.sha256[:16]}-" in prepared.folder.name
    assert not (prepared.folder / "tokenizer").exists()
    assert prepared.manifest["tokenizer"]["sha256"] == tokenizer.sha256
    tokens = ShardSet(prepared.shards, "train")
    texts = [d.text for d in docs if document_unit(d.text) >= 0.05]
    expected = np.concatenate([np.asarray(ids) for ids in tokenizer.encode_batch_documents(texts, 0)])
    assert np.array_equal(tokens.tokens(0, tokens.token_count), expected)
    tokens.close()


PREPARE = """
import hashlib, sys
from trainer.data import python_corpus
docs = python_corpus.documents()[:{subset}]
python_corpus.documents = lambda: docs
{patch}
prepared = python_corpus.ensure_prepared(256, say=lambda line: print(line, flush=True))
tokens = b"".join(p.read_bytes() for p in sorted(prepared.shards.glob("*/*.tokens")))
print("folder", prepared.folder, hashlib.sha256(tokens).hexdigest())
"""


def start(patch: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PREPARE.format(subset=SUBSET, patch=patch)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_processes_starting_together_prepare_once_and_read_the_same_tokens(own_cache, measured):
    # Tokenizing starts 2 s late: whichever process prepares, the other comes while it does.
    slow = ("import time, trainer.data.prepare as p; real = p.prepare; "
            "p.prepare = lambda *a, **k: (time.sleep(2), real(*a, **k))[1]")
    started = time.perf_counter()
    first, second = start(slow), start(slow)
    outputs = [p.communicate(timeout=120) for p in (first, second)]
    measured(f"python_stdlib: two processes preparing a {SUBSET}-document subset at once: "
             f"{time.perf_counter() - started:.1f} s (2 s of it a wait the test adds)")
    assert all(p.returncode == 0 for p in (first, second)), outputs
    lines = [out.splitlines() for out, _ in outputs]
    assert sum(line.startswith("preparing the python_stdlib corpus") for out in lines for line in out) == 1
    assert sum(line.startswith("waiting for another process preparing") for out in lines for line in out) == 1
    assert lines[0][-1] == lines[1][-1]  # one folder, the same tokens
    folders = [p.name for p in own_cache.iterdir()]
    assert len(folders) == 2 and sum(name.endswith(".lock") for name in folders) == 1  # no temporary folder left


def test_a_killed_preparation_is_not_taken_as_complete(own_cache, monkeypatch):
    # Killed (SIGKILL) while tokenizing: only a temporary folder is left, and the lock is free.
    hang = "import time, trainer.data.prepare as p; p.prepare = lambda *a, **k: time.sleep(600)"
    victim = start(hang)
    for _ in range(600):
        if list(own_cache.glob("*.partial-*/tokenizer/tokenizer.json")):
            break
        time.sleep(0.1)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    left = sorted(p.name for p in own_cache.iterdir())
    assert len(left) == 2 and any(".partial-" in name for name in left) and any(n.endswith(".lock") for n in left)
    subset(monkeypatch)
    said = []
    prepared = python_corpus.ensure_prepared(256, say=said.append)
    assert said[0].startswith("preparing the python_stdlib corpus (30 documents")
    assert sorted(p.name for p in own_cache.iterdir()) == [prepared.folder.name, prepared.folder.name + ".lock"]
    # A damaged folder under the final name (a shard cut short) is prepared again, with a warning.
    shard = next(prepared.shards.glob("train/*.tokens"))
    shard.write_bytes(shard.read_bytes()[:-2])
    said.clear()
    again = python_corpus.ensure_prepared(256, say=said.append)
    assert again.folder == prepared.folder and len(said) == 2 and said[0].startswith("preparing")
    assert ShardSet(again.shards, "train").token_count == prepared.manifest["totals"]["train"]["tokens"]
