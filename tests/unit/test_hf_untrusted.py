"""A Hugging Face folder is untrusted: its index may name files outside it, its safetensors headers
may lie, its config.json may hold anything. Reading one yields its weights or one HFCheckpointError
(a ValueError: the checkpoint manager turns it into its one-line CheckpointError) naming the file,
and the entry or tensor; never a file read outside the folder, never another exception."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.hf.folder import INDEX_FILE, read_hf_folder, write_hf_folder
from trainer.hf.model_io import HFWeights
from trainer.hf.weights import HFCheckpointError
from trainer.models.llama3 import Transformer, get_flavor


def tiny_args():
    args = get_flavor("tiny")
    args.max_seq_len = 64
    return args


def state_of(args, seed=0):
    model = Transformer(args)
    model.init_weights(seed)
    return model.state_dict()


@pytest.fixture
def sharded(tmp_path):
    """A folder of several shards and their index, and a complete copy of the same weights in one
    file beside it, outside the folder (what a traversing index would reach)."""
    args = tiny_args()
    write_hf_folder(tmp_path / "hf", state_of(args), args, shard_bytes=200_000)
    write_hf_folder(tmp_path / "outside", state_of(args), args)
    return tmp_path / "hf", args


def rewrite_index(folder, change):
    index = json.loads((folder / INDEX_FILE).read_text())
    change(index["weight_map"])
    (folder / INDEX_FILE).write_text(json.dumps(index))


def first_entry(folder) -> tuple[str, str]:
    return next(iter(json.loads((folder / INDEX_FILE).read_text())["weight_map"].items()))


@pytest.mark.parametrize("name", [
    "../outside/model.safetensors",
    "../../../../etc/hostname",
    "{outside}/model.safetensors",  # an absolute path
    "sub/model-00001-of-00002.safetensors",
    "..",
    "",
])
def test_an_index_entry_that_is_not_a_file_name_in_the_folder_is_refused_unread(sharded, name):
    folder, args = sharded
    name = name.format(outside=folder.parent / "outside")
    tensor, _ = first_entry(folder)
    rewrite_index(folder, lambda weight_map: weight_map.update({tensor: name}))
    with pytest.raises(HFCheckpointError) as error:
        read_hf_folder(folder, args)
    message = str(error.value)
    assert message.startswith(f"{folder / INDEX_FILE}: weight_map entry {tensor!r}: {name!r} is not a file name "
                              "inside the folder"), message


def test_a_shard_that_links_outside_the_folder_is_refused(sharded):
    folder, args = sharded
    tensor, shard = first_entry(folder)
    os.remove(folder / shard)
    os.symlink(folder.parent / "outside" / "model.safetensors", folder / shard)
    with pytest.raises(HFCheckpointError, match=f"weight_map entry '{tensor}': '{shard}' is a link to "):
        read_hf_folder(folder, args)


def test_a_single_file_folder_whose_weights_link_outside_is_refused(tmp_path):
    args = tiny_args()
    write_hf_folder(tmp_path / "hf", state_of(args), args)
    write_hf_folder(tmp_path / "outside", state_of(args), args)
    os.remove(tmp_path / "hf" / "model.safetensors")
    os.symlink(tmp_path / "outside" / "model.safetensors", tmp_path / "hf" / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="model.safetensors' is a link to .* outside the folder"):
        read_hf_folder(tmp_path / "hf", args)


def test_a_link_inside_the_folder_is_read(sharded):
    folder, args = sharded
    _, shard = first_entry(folder)
    os.rename(folder / shard, folder / "moved.safetensors")
    os.symlink("moved.safetensors", folder / shard)
    assert read_hf_folder(folder, args).keys() == {k for k in state_of(args) if k != "freqs_cis"}


def test_a_missing_shard_is_named_with_the_index_entry(sharded):
    folder, args = sharded
    tensor, shard = first_entry(folder)
    os.remove(folder / shard)
    with pytest.raises(HFCheckpointError, match=f"{shard} is missing \\(the weight_map entry of '{tensor}'"):
        read_hf_folder(folder, args)


@pytest.mark.parametrize("index, fragment", [
    ("{", "not readable JSON"),
    ("[]", "expected a JSON object with a \"weight_map\" object"),
    ('{"weight_map": []}', "expected a JSON object with a \"weight_map\" object"),
    ('{"weight_map": {"model.norm.weight": 7}}', "weight_map entry 'model.norm.weight': 7 is not a file name"),
])
def test_an_unreadable_index_is_named(sharded, index, fragment):
    folder, args = sharded
    (folder / INDEX_FILE).write_text(index)
    with pytest.raises(HFCheckpointError, match=f"{INDEX_FILE}: .*{fragment}"):
        read_hf_folder(folder, args)


def test_a_tensor_the_index_places_in_another_shard_is_named(sharded):
    folder, args = sharded
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    tensor = next(t for t, f in weight_map.items() if f == shards[0])
    rewrite_index(folder, lambda m: m.update({tensor: shards[1]}))
    with pytest.raises(HFCheckpointError, match=f"{shards[1]}: holds no tensor {tensor} \\(the index places it there"):
        read_hf_folder(folder, args)


def single_file(tmp_path):
    args = tiny_args()
    write_hf_folder(tmp_path / "hf", state_of(args), args)
    return tmp_path / "hf", tmp_path / "hf" / "model.safetensors", args


def test_a_header_length_past_the_end_of_the_file_is_refused(tmp_path):
    folder, path, args = single_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 62)
    path.write_bytes(bytes(data))
    with pytest.raises(HFCheckpointError, match=f"{path}: not a safetensors file: its header length "
                                                f"{1 << 62} is past the end of the file"):
        read_hf_folder(folder, args)


def test_a_header_that_is_not_json_is_refused(tmp_path):
    folder, path, args = single_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[8] = ord("#")
    path.write_bytes(bytes(data))
    with pytest.raises(HFCheckpointError, match=f"{path}: not a safetensors file: its header is not JSON"):
        read_hf_folder(folder, args)


def test_a_truncated_file_names_the_tensor_past_its_end(tmp_path):
    folder, path, args = single_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(HFCheckpointError, match=f"{path}: tensor model.norm.weight: its data ends at byte 919808, past the end of the file"):
        read_hf_folder(folder, args)


def test_a_tensor_of_another_shape_than_config_json_says_is_named(tmp_path):
    folder, path, args = single_file(tmp_path)
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(path))
    with pytest.raises(HFCheckpointError, match=f"{path}: tensor model.layers.1.mlp.up_proj.weight has shape "
                                                r"\[3, 64\], but config.json's model needs \[192, 64\]"):
        read_hf_folder(folder, args)


def test_a_tensor_that_is_not_floating_point_is_named(tmp_path):
    folder, path, args = single_file(tmp_path)
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    save_file(tensors, str(path))
    with pytest.raises(HFCheckpointError, match=f"{path}: tensor model.norm.weight has dtype I64; expected a "
                                                "floating-point type"):
        read_hf_folder(folder, args)


def test_the_trainer_gets_one_value_error_it_reports_as_one_line(sharded):
    """HFWeights.load is what checkpoint.initial_load_in_hf calls; the manager turns a ValueError
    into its CheckpointError (trainer/checkpoint/manager.py, _load_external)."""
    folder, args = sharded
    tensor, _ = first_entry(folder)
    rewrite_index(folder, lambda m: m.update({tensor: "../../../../etc/hostname"}))
    model = Transformer(args)
    with pytest.raises(ValueError, match="is not a file name inside the folder"):
        HFWeights(model, args).load(folder)


def test_the_converter_command_says_one_line(sharded, capsys):
    from trainer.hf.__main__ import main

    folder, _ = sharded
    tensor, _ = first_entry(folder)
    rewrite_index(folder, lambda m: m.update({tensor: "../../../../etc/hostname"}))
    assert main(["import", "--hf", str(folder), "--flavor", "tiny", "--out", str(folder.parent / "dcp")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "../../../../etc/hostname" in err


@pytest.mark.parametrize("field, value, fragment", [
    ("tie_word_embeddings", "false", "tie_word_embeddings = 'false' is not true or false"),
    ("rope_scaling", [8.0], "rope_scaling = [8.0] is not an object or null"),
    ("rope_parameters", "default", "rope_parameters = 'default' is not an object or null"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps = '1e-5' is not a finite number > 0"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps = nan is not a finite number > 0"),
    ("num_key_value_heads", "2", "num_key_value_heads = '2' is not an integer >= 1"),
    ("hidden_size", True, "hidden_size = True is not an integer >= 1"),
    ("head_dim", "16", "head_dim = '16' is not an integer >= 1"),
])
def test_config_json_values_of_the_wrong_type_are_named(tmp_path, field, value, fragment):
    folder, _, args = single_file(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(HFCheckpointError, match=f"config.json: {fragment}".replace("[", "\\[").replace("(", "\\(")):
        read_hf_folder(folder, args)


def test_a_llama3_rope_scaling_without_its_factors_is_named(tmp_path):
    folder, _, args = single_file(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8}}))
    with pytest.raises(HFCheckpointError, match="rope_scaling.low_freq_factor = None is not a finite number > 0"):
        read_hf_folder(folder, args)


def test_a_config_json_that_links_outside_the_folder_is_refused(tmp_path):
    folder, _, args = single_file(tmp_path)
    (tmp_path / "elsewhere.json").write_text((folder / "config.json").read_text())
    os.remove(folder / "config.json")
    os.symlink(tmp_path / "elsewhere.json", folder / "config.json")
    with pytest.raises(HFCheckpointError, match="'config.json' is a link to .*elsewhere.json, outside the folder"):
        read_hf_folder(folder, args)


def test_a_job_with_the_hf_flavor_names_a_wrong_field_of_config_json(tmp_path):
    from trainer.config.manager import ConfigError, load_config

    folder, _, _ = single_file(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": "llama3"}))
    with pytest.raises(ConfigError, match="config.json: rope_scaling = 'llama3' is not an object or null"):
        load_config(["--model.flavor", "hf", "--model.hf_assets_path", str(folder)])


def test_a_hugging_face_cache_snapshot_links_to_its_own_blobs(tmp_path):
    """models--org--name/snapshots/<revision>/ holds links to ../../blobs/<hash>: its own files."""
    args = tiny_args()
    write_hf_folder(tmp_path / "plain", state_of(args), args)
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        os.rename(tmp_path / "plain" / name, repo / "blobs" / f"hash-{name}")
        os.symlink(f"../../blobs/hash-{name}", snapshot / name)
    assert read_hf_folder(snapshot, args).keys() == {k for k in state_of(args) if k != "freqs_cis"}
