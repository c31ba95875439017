"""Fuzzing a prepared shard folder (trainer.data.shards): its manifest.json, its token shards,
the names and links in it, and the part records `prepare` resumes from. Hundreds of hostile
variants of a genuine folder (tests/fuzz.py): each reads every sequence of both splits with ids
inside the vocabulary, or is refused with one DataError naming the folder's file; no file outside
the folder is opened."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest

from tests.fuzz import check, dump, files_opened, mutate_bytes, mutate_tree, outside
from tests.unit.test_tokenizer import sentences
from trainer.data.documents import DataError
from trainer.data.finite_sources import ShardSource
from trainer.data.prepare import _check_output, _done_record, prepare
from trainer.data.shards import MANIFEST, SPLITS, read_manifest
from trainer.data.tokenizer import train_hf_tokenizer

CASES = 150  # per file and kind of mutation
SEQ = 16
TRAVERSALS = ["../../outside/train/{name}", "../outside/train/{name}", "/etc/hostname", "{root}/outside/train/{name}",
              "..", ".", "", "a/b", "{name}\x00", "{name}\n", "x" * 300, "\ud800"]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A prepared folder of three source files (shards/) and a copy beside it (outside/): what a
    traversing name or a link would reach."""
    root = tmp_path_factory.mktemp("shards")
    (root / "corpus.txt").write_text("\n".join(sentences(500)) + "\n")
    tokenizer = train_hf_tokenizer([str(root / "corpus.txt")], str(root / "tok"), 300)
    (root / "data").mkdir()
    for i, part in enumerate((sentences(60, seed=1), sentences(40, seed=2), sentences(80, seed=3))):
        (root / "data" / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    prepare([str(root / "data")], str(tokenizer), str(root / "shards"), workers=1, validation_fraction=0.3)
    shutil.copytree(root / "shards", root / "outside")
    return root


@pytest.fixture
def folder(tmp_path, genuine):
    shutil.copytree(genuine / "shards", tmp_path / "shards")
    shutil.copytree(genuine / "outside", tmp_path / "outside")
    return tmp_path / "shards"


def read_everything(folder) -> None:
    """What a run does with the folder: read every sequence of both splits; what the preflight
    reads of the manifest."""
    for split in SPLITS:
        source = ShardSource(str(folder), split)
        try:
            count = source.rows_per_epoch(SEQ)
            rows = source.rows(0, count, SEQ) if count else np.zeros((0, SEQ), dtype=np.int64)
            assert rows.size == 0 or 0 <= rows.min() <= rows.max() < source.shards.vocab_size
            source.describe(), source.fingerprint()
        finally:
            source.shards.close()
    manifest = read_manifest(folder)
    assert isinstance(manifest["totals"]["validation"]["tokens"], int)
    assert isinstance(manifest["tokenizer"]["vocab_size"], int) and isinstance(manifest["tokenizer"]["sha256"], str)


def load_each(folder, file: str, variants) -> dict[str, int]:
    """Write each (case, bytes) over folder/file, read the folder, put the genuine file back."""
    original = (folder / file).read_bytes()
    outcomes = {"loaded": 0, "refused": 0}
    for case, data in variants:
        (folder / file).write_bytes(data)
        with files_opened() as opened:
            outcomes[check(case, lambda: read_everything(folder), DataError, folder)] += 1
        assert not outside(opened, folder.parent / "outside", "/etc"), f"{case}: read outside the folder"
    (folder / file).write_bytes(original)
    return outcomes


def test_manifest_mutations_load_or_are_refused(folder):
    rng = random.Random(0)
    data = (folder / MANIFEST).read_bytes()
    manifest = json.loads(data)
    variants = [mutate_bytes(data, rng) for _ in range(CASES)]
    variants += [(case, dump(tree)) for case, tree in (mutate_tree(manifest, rng) for _ in range(CASES * 4 // 3))]
    for _ in range(CASES // 3):  # a source named out of its folder
        index = rng.randrange(len(manifest["sources"]))
        name = rng.choice(TRAVERSALS).format(name=manifest["sources"][index]["name"], root=folder.parent)
        sources = [dict(s, name=name) if i == index else s for i, s in enumerate(manifest["sources"])]
        variants.append((f"sources[{index}].name = {name!r}", dump({**manifest, "sources": sources})))
    outcomes = load_each(folder, MANIFEST, variants)
    assert outcomes["loaded"] and outcomes["refused"] > CASES, outcomes


@pytest.mark.parametrize("split", SPLITS)
def test_token_shard_mutations_load_or_are_refused(folder, split):
    """A flipped byte may make an id beyond the vocabulary (refused when read), a cut or an
    insert a shard of another size (refused on opening)."""
    rng = random.Random(1)
    shard = sorted((folder / split).glob("*.tokens"))[0]
    variants = [mutate_bytes(shard.read_bytes(), rng) for _ in range(CASES)]
    outcomes = load_each(folder, shard.relative_to(folder), variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes


@pytest.mark.parametrize("target", ["outside", "/etc/hostname", "loop", "dangling", "folder", "inside"])
def test_each_file_replaced_by_a_link_loads_or_is_refused(folder, target):
    """manifest.json and every shard and shard index, each in turn a link: out of the folder
    (refused unread), round in a loop, to nothing or to a folder (refused), or in the folder."""
    files = [MANIFEST] + sorted(str(p.relative_to(folder)) for split in SPLITS for p in (folder / split).iterdir())
    for file in files:
        original = folder / file
        os.rename(original, original.with_name(f"moved-{original.name}"))
        where = {"outside": folder.parent / "outside" / file, "/etc/hostname": "/etc/hostname", "loop": original,
                 "dangling": folder / "nothing", "folder": folder.parent / "outside",
                 "inside": f"moved-{original.name}"}[target]
        os.symlink(where, original)
        with files_opened() as opened:
            outcome = check(f"{file} -> {target}", lambda: read_everything(folder), DataError, folder)
        assert not outside(opened, folder.parent / "outside", "/etc"), f"{file} -> {target}: read outside the folder"
        assert outcome == ("loaded" if target == "inside" else "refused"), f"{file} -> {target}: {outcome}"
        os.remove(original)
        os.rename(original.with_name(f"moved-{original.name}"), original)


def test_a_split_folder_that_is_a_link_is_read(folder):
    """Links above the files (the folder, a split folder on another disk) are the user's layout."""
    shutil.rmtree(folder / "train")
    os.symlink(folder.parent / "outside" / "train", folder / "train")
    read_everything(folder)


def test_part_records_prepare_resumes_from_are_reused_or_prepared_again(folder):
    """`prepare` run again reuses a part whose record (parts/<name>.json) matches its shards; a
    damaged or hostile record is prepared again, never an exception."""
    rng = random.Random(2)
    manifest = json.loads((folder / MANIFEST).read_text())
    settings, name = manifest["settings"], manifest["sources"][0]["name"]
    task = {"name": name, "path": manifest["sources"][0]["path"]}
    part = folder / "parts" / f"{name}.json"
    data = part.read_bytes()
    assert _done_record(folder, task, settings) == json.loads(data)
    variants = [mutate_bytes(data, rng) for _ in range(CASES // 2)]
    variants += [(case, dump(tree)) for case, tree in (mutate_tree(json.loads(data), rng) for _ in range(CASES))]
    reused = 0
    for case, mutated in variants:
        part.write_bytes(mutated)
        record = _done_record(folder, task, settings)  # any exception fails the test
        if record is not None:
            reused += 1
            assert record["name"] == name and record["sha256"] == json.loads(data)["sha256"], case
    assert 0 < reused < len(variants)
    # The manifest of an earlier preparation decides whether the folder may be completed.
    for case, mutated in [mutate_bytes((folder / MANIFEST).read_bytes(), rng) for _ in range(CASES // 2)]:
        (folder / MANIFEST).write_bytes(mutated)
        check(case, lambda: _check_output(folder, settings, overwrite=False), DataError, folder)
