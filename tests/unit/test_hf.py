"""Hugging Face Llama interop: logits equal transformers', export/import is the identity."""

from __future__ import annotations

import contextlib
import io
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
        if args.tie_embeddings:  # state_dict() names the tied weight twice; a checkpoint holds it once
            state = {**state, "output.weight": state["tok_embeddings.weight"]}
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


def converter(*args: str) -> tuple[int, str]:
    """`python -m trainer.hf ARGS`, run as its main in this process (torch is imported already):
    its exit status and what it wrote to stderr. test_export_with_flavor_hf_needs_the_folder_of_shapes
    runs the module itself."""
    from trainer.hf.__main__ import main

    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        status = main(list(args))
    return status, err.getvalue()


def test_converter_command_round_trip(tmp_path):
    args = tiny_args()
    args.max_seq_len = 2048  # what get_flavor gives the command line
    state = our_model(args, seed=9).state_dict()
    write_hf_folder(tmp_path / "hf", state, args)
    status, err = converter("import", "--hf", str(tmp_path / "hf"), "--flavor", "tiny", "--out", str(tmp_path / "dcp"))
    assert status == 0, err
    status, err = converter("export", "--dcp", str(tmp_path / "dcp"), "--flavor", "tiny", "--out",
                            str(tmp_path / "hf2"))
    assert status == 0, err
    back = read_hf_folder(tmp_path / "hf2", args)
    assert all(torch.equal(back[k], state[k]) for k in back)
    status, err = converter("export", "--dcp", str(tmp_path / "dcp"), "--flavor", "tiny", "--out",
                            str(tmp_path / "hf2"))
    assert status == 2 and "exists; choose a new folder" in err


# ---------------------------------------------------------------------------------------------
# Tied embeddings (Llama 3.2) and models built from a config.json


def tied_transformers_model(folder):
    """A tiny Llama 3.2-style model (tied output, Llama 3 RoPE scaling) saved by transformers."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(folder)
    return model


def test_a_tied_llama_32_style_checkpoint_round_trips_with_transformers(tmp_path):
    from safetensors.torch import load_file

    from trainer.models.llama3.hf_config import model_args

    tied_transformers_model(tmp_path / "hf")
    args = model_args("hf", str(tmp_path / "hf"))
    assert args.tie_embeddings and args.rope_scaling.factor == 32.0 and args.ffn_hidden_dim == 192
    args.max_seq_len = 64
    ours = our_model(args, read_hf_folder(tmp_path / "hf", args))
    assert ours.output.weight is ours.tok_embeddings.weight
    with torch.no_grad():
        imported = (ours(TOKENS) - hf_logits(tmp_path / "hf", TOKENS)).abs().max().item()
    write_hf_folder(tmp_path / "back", ours.state_dict(), args)
    with torch.no_grad():
        exported = (ours(TOKENS) - hf_logits(tmp_path / "back", TOKENS)).abs().max().item()
    print(f"tied: max |logit diff| imported {imported:.2e}, exported {exported:.2e}")
    assert imported <= 1e-5 and exported <= 1e-5
    written = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert "lm_head.weight" not in written  # as transformers writes a tied model
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is True
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(written[k], original[k]) for k in written)


def test_a_tied_folder_whose_lm_head_differs_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from trainer.models.llama3.hf_config import model_args

    tied_transformers_model(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
              str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        read_hf_folder(tmp_path / "hf", model_args("hf", str(tmp_path / "hf")))


@pytest.mark.parametrize("flavor, published", [("1B", 1_235_814_400), ("3B", 3_212_749_824)])
def test_llama_32_config_json_gives_the_shipped_flavor(tmp_path, flavor, published):
    """The config.json of Llama-3.2-1B / 3B (written here by transformers from the published
    numbers) builds the same shapes as the shipped flavor, with the published parameter count."""
    from trainer.models.llama3.hf_config import model_args
    from trainer.models.llama3.model import count_params_on_meta

    shapes = {"1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32),
              "3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24)}[flavor]
    transformers.LlamaConfig(
        **shapes, intermediate_size=8192, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}).save_pretrained(tmp_path)
    built, shipped = model_args("hf", str(tmp_path)), get_flavor(flavor)
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim", "norm_eps", "rope_theta",
                  "rope_scaling", "tie_embeddings"):
        assert getattr(built, field) == getattr(shipped, field), field
    assert count_params_on_meta(built) == published


def test_unsupported_config_fields_are_refused_by_name(tmp_path):
    from trainer.models.llama3.hf_config import HFConfigError, model_args

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=256, attention_bias=True, mlp_bias=True,
                                      hidden_act="gelu",
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}).to_dict()
    config["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError) as error:
        model_args("hf", str(tmp_path))
    for named in ("attention_bias = true", "mlp_bias = true", "sliding_window = 4096", "hidden_act = 'gelu'",
                  "rope_scaling type 'yarn'"):
        assert named in str(error.value)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": None,
                                                      "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                                                      "rope_scaling": None, "rope_parameters": None}))
    with pytest.raises(HFConfigError, match="model_type = 'mistral'"):
        model_args("hf", str(tmp_path))


def test_the_hf_flavor_in_a_job_config(tmp_path):
    from trainer.config.manager import ConfigError, load_config
    from trainer.parallel.dims import ParallelDims, layout_problems

    tied_transformers_model(tmp_path / "hf")
    config = load_config(["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path / "hf")])
    assert config.model.flavor == "hf"
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path)])
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    problems = layout_problems(config, ParallelDims.from_config(config.parallelism, 2))
    assert any("V-shaped schedule puts the first and the last stage on one rank" in p for p in problems), problems
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    assert layout_problems(config, ParallelDims.from_config(config.parallelism, 2)) == []


def test_converter_command_with_shapes_from_the_folder(tmp_path):
    tied_transformers_model(tmp_path / "hf")
    status, err = converter("import", "--hf", str(tmp_path / "hf"), "--flavor", "hf", "--out", str(tmp_path / "dcp"))
    assert status == 0, err
    status, err = converter("export", "--dcp", str(tmp_path / "dcp"), "--flavor", "hf", "--hf-assets",
                            str(tmp_path / "hf"), "--out", str(tmp_path / "hf2"))
    assert status == 0, err
    from safetensors.torch import load_file

    back, original = (load_file(str(tmp_path / f / "model.safetensors")) for f in ("hf2", "hf"))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)


def test_export_with_flavor_hf_needs_the_folder_of_shapes(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.hf", "export", "--dcp", str(tmp_path), "--flavor", "hf",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "--flavor hf takes the shapes from a config.json: give --hf-assets" in result.stderr
