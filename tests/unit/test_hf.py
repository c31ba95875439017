"""Hugging Face Llama interop: logits equal transformers', export/import is the identity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from tests.launch import REPO
from trainer.models.llama3 import Transformer, get_flavor
from trainer.models.llama3.args import RopeScaling
from trainer.hf.folder import read_hf_folder, write_hf_folder
from trainer.hf.weights import HFCheckpointError


def tiny_args(scaled: bool = False):
    args = get_flavor("tiny")
    args.max_seq_len = 64
    if scaled:  # thresholds inside the tiny head's frequency range, so scaling changes the result
        args.rope_scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=16)
    return args


def hf_logits(folder, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def our_model(args, state=None, seed=0):
    model = Transformer(args)
    if state is None:
        model.init_weights(seed)
    else:
        model.init_weights(seed)  # fills the RoPE table; weights are replaced next
        model.load_state_dict(state, strict=True)
    return model.eval()


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def test_import_of_a_transformers_model_gives_its_logits(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, rope_theta=500000.0,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    hf_model = transformers.LlamaForCausalLM(config)
    for p in hf_model.parameters():  # make norms non-trivial too
        torch.nn.init.normal_(p, std=0.2)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = our_model(tiny_args(), read_hf_folder(tmp_path / "hf", tiny_args()))
    with torch.no_grad():
        diff = (ours(TOKENS) - hf_logits(tmp_path / "hf", TOKENS)).abs().max().item()
    print(f"imported transformers model: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("scaled", [False, True], ids=["plain RoPE", "Llama 3.1 RoPE scaling"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, scaled):
    args = tiny_args(scaled)
    ours = our_model(args, seed=3)
    write_hf_folder(tmp_path / "hf", ours.state_dict(), args)
    with torch.no_grad():
        diff = (ours(TOKENS) - hf_logits(tmp_path / "hf", TOKENS)).abs().max().item()
    print(f"exported ({'scaled' if scaled else 'plain'} RoPE): max |logit diff| in transformers {diff:.2e}")
    assert diff <= 1e-5
    if scaled:  # scaling moves the logits 10x more than the match tolerance: transformers applied it too
        plain = our_model(tiny_args(False), ours.state_dict(), seed=3)
        with torch.no_grad():
            assert (plain(TOKENS) - ours(TOKENS)).abs().max().item() > 1e-4


def test_export_then_import_is_the_identity(tmp_path):
    args = tiny_args()
    state = our_model(args, seed=5).state_dict()
    write_hf_folder(tmp_path / "hf", state, args)
    back = read_hf_folder(tmp_path / "hf", args)
    assert back.keys() == {k for k in state if k != "freqs_cis"}
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_bf16_export_dtype(tmp_path):
    args = tiny_args()
    write_hf_folder(tmp_path / "hf", our_model(args).state_dict(), args, torch.bfloat16)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(tmp_path / "hf" / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_mismatched_or_incomplete_folders(tmp_path):
    args = tiny_args()
    write_hf_folder(tmp_path / "hf", our_model(args).state_dict(), args)
    other = get_flavor("debugmodel")
    with pytest.raises(HFCheckpointError, match=r"hidden_size = 64 \(the configured model has 256\)"):
        read_hf_folder(tmp_path / "hf", other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="missing tensor lm_head.weight"):
        read_hf_folder(tmp_path / "hf", args)
    with pytest.raises(HFCheckpointError, match="no config.json"):
        read_hf_folder(tmp_path, args)


def test_converter_command_round_trip(tmp_path):
    args = tiny_args()
    args.max_seq_len = 2048  # what get_flavor gives the command line
    state = our_model(args, seed=9).state_dict()
    write_hf_folder(tmp_path / "hf", state, args)
    command = [sys.executable, "-m", "trainer.hf"]
    imported = subprocess.run([*command, "import", "--hf", str(tmp_path / "hf"), "--flavor", "tiny", "--out",
                               str(tmp_path / "dcp")], capture_output=True, text=True, cwd=REPO)
    assert imported.returncode == 0, imported.stderr
    exported = subprocess.run([*command, "export", "--dcp", str(tmp_path / "dcp"), "--flavor", "tiny", "--out",
                               str(tmp_path / "hf2")], capture_output=True, text=True, cwd=REPO)
    assert exported.returncode == 0, exported.stderr
    back = read_hf_folder(tmp_path / "hf2", args)
    assert all(torch.equal(back[k], state[k]) for k in back)
    again = subprocess.run([*command, "export", "--dcp", str(tmp_path / "dcp"), "--flavor", "tiny", "--out",
                            str(tmp_path / "hf2")], capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 2 and "exists; choose a new folder" in again.stderr
