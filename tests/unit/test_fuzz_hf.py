"""Fuzzing a Hugging Face folder (trainer.hf.folder.read_hf_folder): its config.json, its
model.safetensors.index.json and the safetensors files it names, each mutated hundreds of ways
from a genuine sharded folder (tests/fuzz.py), and replaced by links. Every case loads the
model's tensors with their shapes, or is refused with one HFCheckpointError naming the folder's
file; no file outside the folder is opened. The config.json variants also go through the light
check the config validator runs (read_checked_config, the "hf" flavor's shapes): HFConfigError."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import pytest

from tests.fuzz import check, dump, files_opened, mutate_bytes, mutate_tree, outside
from tests.unit.test_hf_untrusted import state_of, tiny_args
from trainer.hf.config_json import read_checked_config
from trainer.hf.folder import INDEX_FILE, read_hf_folder, write_hf_folder
from trainer.hf.weights import HFCheckpointError
from trainer.models.llama3.hf_config import HFConfigError, model_args

CASES = 120  # per file and kind of mutation
# What a hostile file name may point at: the complete copy beside the folder, and a system file.
TRAVERSALS = ["../outside/model.safetensors", "../../outside/model.safetensors", "/etc/hostname",
              "{outside}/model.safetensors", "./model.safetensors", "sub/x.safetensors", "model.safetensors\x00.x"]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A sharded folder (hf/) and, beside it, a complete single-file copy of the same weights
    (outside/): what a traversing name would reach. Returns (root, args, {tensor: shape})."""
    root = tmp_path_factory.mktemp("hf")
    args = tiny_args()
    args.n_layers = 2  # the tiny flavor's shapes with half its layers: each load reads 21 tensors
    state = state_of(args)
    write_hf_folder(root / "hf", state, args, shard_bytes=200_000)
    write_hf_folder(root / "outside", state, args)
    return root, args, {k: tuple(v.shape) for k, v in state.items() if k != "freqs_cis"}


@pytest.fixture
def folder(tmp_path, genuine):
    """A fresh copy of the genuine folder, with the outside copy beside it."""
    root, _, _ = genuine
    shutil.copytree(root / "hf", tmp_path / "hf")
    shutil.copytree(root / "outside", tmp_path / "outside")
    return tmp_path / "hf"


def load_each(folder, genuine, file: str, variants) -> dict[str, int]:
    """Write each (case, bytes) over folder/file, load the folder, put the genuine file back."""
    _, args, shapes = genuine
    original = (folder / file).read_bytes()
    outcomes = {"loaded": 0, "refused": 0}

    def loaded(state):
        assert {k: tuple(v.shape) for k, v in state.items()} == shapes

    for case, data in variants:
        (folder / file).write_bytes(data)
        with files_opened() as opened:
            outcomes[check(case, lambda: read_hf_folder(folder, args), HFCheckpointError, folder, valid=loaded)] += 1
        assert not outside(opened, folder.parent / "outside", "/etc"), f"{case}: read outside the folder"
    (folder / file).write_bytes(original)
    return outcomes


def config_variants(folder, rng):
    data = (folder / "config.json").read_bytes()
    tree = json.loads(data)
    return ([mutate_bytes(data, rng) for _ in range(CASES)]
            + [(case, dump(t)) for case, t in (mutate_tree(tree, rng) for _ in range(CASES))])


def test_config_json_mutations_load_or_are_refused(folder, genuine):
    outcomes = load_each(folder, genuine, "config.json", config_variants(folder, random.Random(0)))
    assert outcomes["refused"] > CASES, outcomes


def test_config_json_mutations_pass_or_fail_the_light_check(folder):
    """The config validator's check of model.hf_assets_path with flavor "hf": no torch, and the
    shapes built from config.json alone (any Llama shape, so more of them pass)."""
    outcomes = {"loaded": 0, "refused": 0}
    for case, data in config_variants(folder, random.Random(1)):
        (folder / "config.json").write_bytes(data)
        outcomes[check(case, lambda: (read_checked_config(folder), model_args("hf", str(folder))), HFConfigError,
                       folder)] += 1
    assert outcomes["loaded"] and outcomes["refused"], outcomes


def test_index_mutations_load_or_are_refused_without_reading_outside(folder, genuine):
    rng = random.Random(2)
    data = (folder / INDEX_FILE).read_bytes()
    tree = json.loads(data)
    variants = [mutate_bytes(data, rng) for _ in range(CASES)]
    variants += [(case, dump(t)) for case, t in (mutate_tree(tree, rng) for _ in range(CASES))]
    for _ in range(CASES // 3):  # a file name pointing out of the folder, for one tensor or all
        name = rng.choice(TRAVERSALS).format(outside=folder.parent / "outside")
        tensors = list(tree["weight_map"]) if rng.random() < 0.3 else [rng.choice(list(tree["weight_map"]))]
        weight_map = {**tree["weight_map"], **dict.fromkeys(tensors, name)}
        variants.append((f"{len(tensors)} entries -> {name!r}", json.dumps({**tree, "weight_map": weight_map}).encode()))
    outcomes = load_each(folder, genuine, INDEX_FILE, variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes


def safetensors_variants(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Mutations of the header (bytes and structure) and of its length, and a few anywhere."""
    length = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    variants = [mutate_bytes(data, rng, span=(0, 8 + length)) for _ in range(CASES)]
    variants += [mutate_bytes(data, rng) for _ in range(CASES // 5)]
    for _ in range(CASES):
        case, tree = mutate_tree(header, rng)
        raw = dump(tree)
        variants.append((case, struct.pack("<Q", len(raw)) + raw + body))
    for wrong in (0, 1, 2, length - 1, length + 1, len(data) - 8, len(data), 100 << 20, 2**63, 2**64 - 1):
        variants.append((f"header length {wrong}", struct.pack("<Q", wrong) + data[8:]))
    return variants


def test_safetensors_mutations_load_or_are_refused(folder, genuine):
    """The first shard: it holds the embedding and the first layers' tensors."""
    rng = random.Random(3)
    shard = sorted(p.name for p in folder.glob("*.safetensors"))[0]
    outcomes = load_each(folder, genuine, shard, safetensors_variants((folder / shard).read_bytes(), rng))
    assert outcomes["loaded"] and outcomes["refused"] > CASES, outcomes


@pytest.mark.parametrize("target", ["outside", "/etc/hostname", "loop", "dangling", "folder", "inside"])
def test_each_file_replaced_by_a_link_loads_or_is_refused(folder, genuine, target):
    """config.json, the index and every shard, each in turn a link: out of the folder (refused
    unread), round in a loop, to nothing or to a folder (refused), or to a file in the folder."""
    _, args, shapes = genuine
    for file in sorted(p.name for p in folder.iterdir()):
        original = folder / file
        os.rename(original, folder / f"moved-{file}")
        twin = "config.json" if file == "config.json" else "model.safetensors"  # its copy outside
        where = {"outside": folder.parent / "outside" / twin, "/etc/hostname": "/etc/hostname", "loop": original, "dangling": folder / "nothing",
                 "folder": folder.parent / "outside", "inside": f"moved-{file}"}[target]
        os.symlink(where, original)
        with files_opened() as opened:
            outcome = check(f"{file} -> {target}", lambda: read_hf_folder(folder, args), HFCheckpointError, folder)
        assert not outside(opened, folder.parent / "outside", "/etc"), f"{file} -> {target}: read outside the folder"
        assert outcome == ("loaded" if target == "inside" else "refused"), f"{file} -> {target}: {outcome}"
        os.remove(original)
        os.rename(folder / f"moved-{file}", original)
    assert {k: tuple(v.shape) for k, v in read_hf_folder(folder, args).items()} == shapes
