"""Float8 linear layers (trainer/float8.py): which layers convert, what is refused before launch,
and what a checkpoint of a float8 run holds. Training with them, in every layout, is
tests/integration/test_float8_training.py."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from dataclasses import replace

import pytest
import torch

from trainer import float8
from trainer.checkpoint.items import unwrapped
from trainer.config.manager import ConfigError, load_config
from trainer.models.llama3 import Transformer
from trainer.models.llama3.args import get_flavor
from trainer.models.llama3.hf_config import hf_config
from trainer.optim import settings_changed
from trainer.preflight.checks import check_torchao_installed

TINY = ["--model.flavor", "tiny", "--model.converters", "float8"]
BLOCK_LINEARS = ["layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv", "layers.*.attention.wo",
                 "layers.*.feed_forward.w1", "layers.*.feed_forward.w3", "layers.*.feed_forward.w2"]


def converted(argv: list[str], args=None) -> tuple[torch.nn.Module, float8.Float8Conversion]:
    config = load_config(argv)
    with torch.device("meta"):
        model = Transformer(args or get_flavor("tiny"))
    return model, float8.convert(model, config, fsdp_shards=2, device=torch.device("cpu"))


def test_every_block_linear_converts_and_the_output_projection_stays_high_precision():
    model, conversion = converted(TINY)
    linears = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(conversion.converted) == 4 * 7 == sum(kind == "Float8Linear" for kind in linears.values())
    assert linears["output"] == "Linear" and conversion.kept == {"output": "the output projection, always"}
    assert conversion.record() == {"recipe": "tensorwise", "converted": 28, "layers": BLOCK_LINEARS,
                                   "high_precision": {"output": "the output projection, always"},
                                   "fsdp_float8_all_gather": False, "precompute_scales": False}
    # The parameters keep their names (checkpoints and exports are the same as without float8).
    with torch.device("meta"):
        plain = Transformer(get_flavor("tiny"))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_filter_fqns_and_shapes_that_are_not_multiples_of_16_keep_layers_in_high_precision():
    _, conversion = converted([*TINY, "--quantize.linear.float8.filter_fqns", "attention.wk,attention.wv"])
    assert conversion.record()["layers"] == [n for n in BLOCK_LINEARS if not n.endswith(("wk", "wv"))]
    assert conversion.record()["high_precision"] == {"layers.*.attention.wk": "filter_fqns 'attention.wk'",
                                                     "layers.*.attention.wv": "filter_fqns 'attention.wv'",
                                                     "output": "the output projection, always"}
    # One key/value head of 64 / 8 = 8 dimensions: wk and wv give 8 features, too few for float8 kernels.
    one_kv_head = replace(get_flavor("tiny"), n_heads=8, n_kv_heads=1)
    _, conversion = converted(TINY, one_kv_head)
    assert conversion.record()["layers"] == [n for n in BLOCK_LINEARS if not n.endswith(("wk", "wv"))]
    assert conversion.kept["layers.0.attention.wk"] == "8 x 64, not multiples of 16"


def test_auto_filter_keeps_what_is_too_small_to_gain():
    _, conversion = converted([*TINY, "--quantize.linear.float8.filter_fqns", "auto_filter_small_kn"])
    assert conversion.converted == ()  # the tiny model's 64-wide layers are far below torchao's thresholds
    assert conversion.kept["layers.0.feed_forward.w1"] == "auto_filter_small_kn: too small to gain"


def test_float8_all_gather_needs_more_than_one_shard_and_tensorwise_scaling():
    config = load_config([*TINY, "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                          "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"])
    for shards, on in ((1, False), (2, True)):
        with torch.device("meta"):
            model = Transformer(get_flavor("tiny"))
        conversion = float8.convert(model, config, fsdp_shards=shards, device=torch.device("cpu"))
        assert (conversion.fsdp_float8_all_gather, conversion.precompute_scales) == (on, on)
        assert ("float8 all-gather" in conversion.describe()) == on


@pytest.mark.parametrize("argv, message", [
    (["--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.enable_fsdp_float8_all_gather"],
     "quantize.linear.float8.enable_fsdp_float8_all_gather: float8 all-gather is tensorwise scaling's"),
    ([*TINY, "--quantize.linear.float8.emulate", "--compile.enable"],
     "quantize.linear.float8.emulate: torchao's emulated float8 matmuls do not compile"),
    ([*TINY, "--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_sync", "per_block"],
     "parallelism.tensor_parallel_sync: 'per_block' computes with each rank's local weight shards"),
    ([*TINY, "--training.enable_cpu_offload"], "training.enable_cpu_offload: not combined with float8 layers"),
    (["--model.converters", "mx"], "argument --model.converters: 'mx' is not valid; choose one of "
                                   "'quantize.linear.float8', 'float8'"),
])
def test_what_float8_does_not_combine_with_is_refused_with_the_key(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(argv)


def test_without_torchao_the_launch_stops_naming_the_extra(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else found(name, *a))
    with pytest.raises(ConfigError, match=r"model.converters: float8 layers need the torchao package, which is not "
                                          r"installed .* pip install -e '.\[float8\]'"):
        check_torchao_installed(load_config(TINY))
    check_torchao_installed(load_config(["--model.flavor", "tiny"]))  # float8 off: torchao is not needed


def test_torchtitans_405b_float8_preset_loads_with_float8_on(tmp_path):
    # torchtitan v0.2.2's Llama 3 405B preset names the converter by its earlier name.
    path = tmp_path / "llama3_405b.toml"
    path.write_text(textwrap.dedent("""
        [model]
        name = "llama3"
        flavor = "405B"
        converters = ["float8"]
        [quantize.linear.float8]
        enable_fsdp_float8_all_gather = true
        precompute_float8_dynamic_scale_for_fsdp = true
        filter_fqns = ["output"]
    """))
    config = load_config(["--job.config_file", str(path)])
    assert float8.enabled(config)
    options = config.quantize.linear.float8
    assert (options.enable_fsdp_float8_all_gather, options.precompute_float8_dynamic_scale_for_fsdp,
            options.filter_fqns, options.recipe_name) == (True, True, ["output"], None)
    # torchtitan's 8B preset: the table with the converter commented out leaves float8 off.
    path.write_text('[quantize.linear.float8]\nenable_fsdp_float8_all_gather = false\nfilter_fqns = ["output"]\n')
    assert not float8.enabled(load_config(["--job.config_file", str(path)]))


def test_a_checkpoint_holds_the_plain_weight_a_float8_all_gather_wrapper_holds():
    float8.import_float8()
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    layer = torch.nn.Linear(32, 16)
    wrapped = WeightWithDynamicFloat8CastTensor(layer.weight.detach(), None, torch.float8_e4m3fn)
    plain = unwrapped(wrapped)
    assert type(plain) is torch.Tensor and plain.data_ptr() == layer.weight.data_ptr()
    assert unwrapped(layer.weight) is layer.weight and unwrapped(3) == 3


def test_a_resume_that_turns_float8_on_or_changes_its_recipe_is_named():
    saved = json.loads(json.dumps({"model": {"converters": []}, "quantize": {"linear": {"float8": {}}}}))
    now = load_config([*TINY, "--quantize.linear.float8.recipe_name", "rowwise"])
    assert settings_changed(saved, now) == ["model.converters [] -> ['float8']",
                                            "quantize.linear.float8.recipe_name None -> 'rowwise'"]


def test_the_hf_config_of_a_model_is_unchanged_by_float8():
    # Conversion changes layers, not shapes: the Hugging Face config.json written for an export.
    model, _ = converted(TINY)
    assert hf_config(model.args) == hf_config(get_flavor("tiny"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_layer_computes_within_float8s_rounding_of_its_high_precision_twin(recipe):
    """torch._scaled_mm on this machine: the converted layer's output and gradients are the high
    precision ones up to float8's rounding: activations and weights in e4m3 (3 significant bits,
    up to 2^-4 relative per element), gradients in e5m2 (2 bits, 2^-3). Measured: 3.5% to 3.7%
    relative error in the output, 3.6% to 4.7% in the weight gradient."""
    config = load_config([*TINY, "--quantize.linear.float8.recipe_name", recipe])
    torch.manual_seed(0)
    high = torch.nn.Sequential(torch.nn.Linear(64, 192, bias=False))
    low = torch.nn.Sequential(torch.nn.Linear(64, 192, bias=False))
    low.load_state_dict(high.state_dict())
    float8.import_float8().convert_to_float8_training(low, config=float8.torchao_config(
        config.quantize.linear.float8, recipe, all_gather=False))
    assert type(low[0]).__name__ == "Float8Linear"
    x = torch.randn(4, 32, 64)
    outputs = [model(x.clone().requires_grad_()) for model in (high, low)]
    for output in outputs:
        output.square().mean().backward()
    error = ((outputs[1] - outputs[0]).norm() / outputs[0].norm()).item()
    grad_error = ((low[0].weight.grad - high[0].weight.grad).norm() / high[0].weight.grad.norm()).item()
    assert 1e-4 < error < 2 ** -4 and 1e-4 < grad_error < 2 ** -3  # float8 ran (not exact), and rounded only


@pytest.fixture
def onednn_setting():
    """torch.backends.mkldnn.enabled restored after the test: the trainer's setting is process-wide."""
    before = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = before


@pytest.mark.parametrize("device, float8_on, amx, onednn", [
    ("cpu", True, True, False), ("cpu", True, False, True), ("cpu", False, True, True), ("cuda", True, True, "kept")])
def test_onednn_is_off_only_for_float8_on_a_cpu_with_amx_and_each_build_sets_it(device, float8_on, amx, onednn,
                                                                               monkeypatch, onednn_setting):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    for before in (True, False):  # what an earlier run in the same process left
        torch.backends.mkldnn.enabled = before
        assert float8.set_onednn(torch.device(device), float8_on) is (onednn is False)
        assert torch.backends.mkldnn.enabled is (before if onednn == "kept" else onednn)


def test_then_no_float8_matmul_runs_on_onednn(onednn_setting, capfd):
    """On this machine's CPU, whichever it is: after the trainer's setting, a float8 matmul runs no
    oneDNN primitive (on a CPU with AMX it ran oneDNN's reference kernel, 69 ms against 0.24 ms in
    float32 for 256 x 64 x 256), and computes the float32 product of its float8 operands."""
    float8.set_onednn(torch.device("cpu"), float8_on=True)
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        product = torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
    assert "matmul" not in capfd.readouterr().out
    assert torch.equal(product, a.float() @ a.float().t())
