"""The streaming Hugging Face export (trainer/hf/export.py): a DCP checkpoint read one tensor at a
time and written as save_pretrained shards, the same tensors as before, and its host memory."""

from __future__ import annotations

import json
import pickle
import warnings
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from trainer.checkpoint.checked_reader import UnsafeCheckpointError
from trainer.hf.__main__ import main as hf_main
from trainer.hf.export import export_hf_folder, export_host_peak_bytes, parse_size, whole_model_export_peak_bytes
from trainer.hf.folder import INDEX_FILE, read_hf_folder, write_hf_tensors
from trainer.hf.weights import HFCheckpointError, key_map, to_hf
from trainer.models.llama3 import Transformer, get_flavor
from trainer.models.llama3.args import num_params
from trainer.models.llama3.hf_config import model_args


def tiny(tied: bool = False):
    args = get_flavor("tiny")
    args.tie_embeddings = tied
    return args


def saved_checkpoint(folder, args, seed=0) -> dict[str, torch.Tensor]:
    """A float32 DCP checkpoint of an initialized model, as a run saves it (a tied output once, as
    the embedding); returns its tensors."""
    model = Transformer(args)
    model.init_weights(seed)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state}, checkpoint_id=str(folder), no_dist=True)
    return state


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_small_shard_size_writes_several_files_and_their_index(tmp_path):
    args = tiny()
    state = saved_checkpoint(tmp_path / "dcp", args)
    shard = parse_size("100KB")
    export_hf_folder(tmp_path / "dcp", tmp_path / "hf", args, torch.float32, shard)
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert index["weight_map"].keys() == set(key_map(args).values())
    assert sorted(set(index["weight_map"].values())) == files
    # total_size: the tensors' bytes, as save_pretrained counts them (229,952 float32 parameters).
    assert index["metadata"]["total_size"] == tensor_bytes(state.values()) == 4 * num_params(args) == 919_808
    for name in files:
        written = load_file(str(tmp_path / "hf" / name))
        assert {k for k, f in index["weight_map"].items() if f == name} == written.keys()
        assert tensor_bytes(written.values()) <= shard or len(written) == 1  # a larger tensor: a file alone


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_then_import_gives_the_same_tensors(tmp_path, tied):
    args = tiny(tied)
    state = saved_checkpoint(tmp_path / "dcp", args, seed=7)
    export_hf_folder(tmp_path / "dcp", tmp_path / "hf", args, torch.float32, parse_size("64KB"))
    back = read_hf_folder(tmp_path / "hf", args)
    assert back.keys() == state.keys() and len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], state[k]) for k in state)
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not tied  # a tied folder holds the embedding only
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is tied


def test_bfloat16_shards_hold_the_cast_tensors(tmp_path):
    args = tiny()
    state = saved_checkpoint(tmp_path / "dcp", args)
    export_hf_folder(tmp_path / "dcp", tmp_path / "hf", args, torch.bfloat16, parse_size("64KB"))
    written = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        written.update(load_file(str(file)))
    expected = to_hf(state, args)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k].to(torch.bfloat16)) for k in expected)
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 2 * num_params(args)


def test_a_model_that_fits_one_shard_is_one_model_safetensors(tmp_path):
    args = tiny()
    state = saved_checkpoint(tmp_path / "dcp", args)
    export_hf_folder(tmp_path / "dcp", tmp_path / "hf", args, torch.float32)  # default: 5GB shards
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    written, expected = load_file(str(tmp_path / "hf" / "model.safetensors")), to_hf(state, args)
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_one_shard_of_tensors_is_held_at_a_time(tmp_path):
    """Each tensor read while the tensors of earlier shards are still alive would mean the export
    holds more than one shard: at every read, the live tensors read before fit in one shard."""
    args = tiny()
    state = saved_checkpoint(tmp_path / "dcp", args)
    shard = parse_size("100KB")
    alive: list[weakref.ref] = []
    in_hand = []

    def read(ours: str) -> torch.Tensor:
        in_hand.append(tensor_bytes(t for t in (ref() for ref in alive) if t is not None))
        tensor = state[ours].clone()  # float32 export: the written tensor is this one
        alive.append(weakref.ref(tensor))
        return tensor

    write_hf_tensors(tmp_path / "hf", args, torch.float32, shard, read)
    assert len(in_hand) == len(state) and max(in_hand) <= shard
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2


def test_the_command_writes_shards_of_max_shard_size(tmp_path):
    args = tiny()
    state = saved_checkpoint(tmp_path / "dcp", args)
    assert hf_main(["export", "--dcp", str(tmp_path / "dcp"), "--flavor", "tiny", "--out", str(tmp_path / "hf"),
                    "--max-shard-size", "0.2MB"]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) == 5  # 920 kB in 200 kB files
    back = read_hf_folder(tmp_path / "hf", args)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("size", ["5XB", "GB", "0", "0.1", "1e9"])
def test_a_bad_max_shard_size_is_refused_by_name(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as exit:
        hf_main(["export", "--dcp", str(tmp_path), "--flavor", "tiny", "--out", str(tmp_path / "hf"),
                 "--max-shard-size", size])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --max-shard-size: {size!r} is not a size: give bytes, or a number with KB, MB, GB" in error
    assert not (tmp_path / "hf").exists()


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("200MB") == 200 * 10**6
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("1.5 gb") == 1_500_000_000
    assert parse_size("1000") == 1000 and parse_size("64KiB") == 65536


def test_a_checkpoint_of_another_model_is_refused_before_writing(tmp_path):
    saved_checkpoint(tmp_path / "dcp", tiny())
    with pytest.raises(HFCheckpointError) as refused:
        export_hf_folder(tmp_path / "dcp", tmp_path / "hf", get_flavor("debugmodel"), torch.float32)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'dcp'}: does not hold the model to export: model.tok_embeddings.weight "
                              "has shape [256, 64], the model's is [2048, 256]")
    assert "more); was it saved with another model flavor?" in message
    assert not (tmp_path / "hf").exists()


class RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_a_crafted_checkpoint_is_refused_unread(tmp_path):
    """The export reads through CheckedReader: a .metadata asking to run a command is refused."""
    folder, marker = tmp_path / "step-10", tmp_path / "marker"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load 'posix.system'"):
        export_hf_folder(folder, tmp_path / "hf", tiny(), torch.float32)
    assert not marker.exists()


def test_host_memory_of_the_405b_export():
    """405B in bfloat16, 5GB shards. The streaming peak is reading the first tensor, the embedding
    (128256 x 16384 float32 = 8,405,385,216 bytes), into its tensor from a chunk as large: twice
    that, with no shard in hand yet (the output layer, the same size, starts the last shard alone).
    The whole-model export held the float32 model (4 x 405,853,388,800 parameters), the permuted
    copies of wq and wk (126 layers x 4 x (16384 + 1024) x 16384) and the bfloat16 copy of
    everything (2 x parameters): 2.58 TB, 153 times as much."""
    args = model_args("405B")
    embedding = 4 * 128256 * 16384
    streaming = export_host_peak_bytes(args, torch.bfloat16, 5 * 10**9)
    assert streaming == 2 * embedding == 16_810_770_432
    params = num_params(args)
    assert params == 405_853_388_800
    whole = whole_model_export_peak_bytes(args, torch.bfloat16)
    assert whole == 4 * params + 126 * 4 * (16384 + 1024) * 16384 + 2 * params == 2_578_867_519_488
    assert whole / streaming > 150
    # A smaller shard size lowers the peak only down to the embedding read: 1 GB shards hold less
    # beside it, and the peak is still that read.
    assert export_host_peak_bytes(args, torch.bfloat16, 10**9) == streaming
    assert export_host_peak_bytes(args, torch.float32, 5 * 10**9) == streaming


def test_shard_counts_of_the_published_llama_folders():
    """In bfloat16 at 5GB the plan gives as many shards as the published Llama 3.1 and 3.2
    folders have (8B: 4, 70B: 30, 405B: 191, 3.2 3B: 2, 1B: one model.safetensors)."""
    from trainer.hf.folder import hf_tensors, shard_plan

    for flavor, count in [("8B", 4), ("70B", 30), ("405B", 191), ("3B", 2), ("1B", 1)]:
        sizes = [t.bytes(torch.bfloat16) for t in hf_tensors(model_args(flavor))]
        assert len(shard_plan(sizes, 5 * 10**9)) == count, flavor


def test_the_weights_are_as_readable_as_the_config(tmp_path):
    """safetensors writes its files for their owner only; the export gives them the folder's mode."""
    args = tiny()
    saved_checkpoint(tmp_path / "dcp", args)
    out = export_hf_folder(tmp_path / "dcp", tmp_path / "hf", args, torch.float32, parse_size("100KB"))
    config_mode = (out / "config.json").stat().st_mode & 0o777
    modes = {f.stat().st_mode & 0o777 for f in out.glob("*.safetensors")}
    assert len(list(out.glob("*.safetensors"))) > 1 and modes == {config_mode}
