"""trainer/parallel/compile.py: what compiled code is given, where it is cached, what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from trainer.config.manager import ConfigError, load_config
from trainer.models.llama3.args import get_flavor
from trainer.models.llama3.model import Transformer
from trainer.parallel import compile as compile_module
from trainer.parallel import local_runtime
from trainer.parallel.activation_checkpointing import RECOMPUTE_ALL
from trainer.parallel.compile import key_compiled_graphs_by_rank, set_memory_budget, wait_for_collectives
from trainer.preflight.checks import check_device_options


def test_an_async_collective_tensor_is_resolved_and_its_gradient_passes_through():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class Doubled(torch.autograd.Function):  # a differentiable op whose output is wrapped, as DTensor's are
        @staticmethod
        def forward(ctx, x):
            return AsyncCollectiveTensor(x * 2)

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    leaf = torch.randn(3, requires_grad=True)
    wrapped = Doubled.apply(leaf)
    assert isinstance(wrapped, AsyncCollectiveTensor) and wrapped.requires_grad
    plain = wait_for_collectives(wrapped)
    assert type(plain) is torch.Tensor and torch.equal(plain, leaf.detach() * 2)
    plain.sum().backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))
    ordinary = torch.ones(2)
    assert wait_for_collectives(ordinary) is ordinary


def test_each_rank_and_layout_keys_its_compiled_graphs_after_the_users_tag(monkeypatch):
    monkeypatch.setattr(compile_module, "_user_tag", None)
    before = torch.compiler.config.cache_key_tag
    # torch's config module, not monkeypatch: monkeypatch's undo would delete the setting.
    with torch.compiler.config.patch(cache_key_tag="mine"):
        degrees = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
        tag = key_compiled_graphs_by_rank(3, degrees)
        assert tag == "mine-rank3-pp1xdp_replicate1xdp_shard2xcp1xtp2" == torch.compiler.config.cache_key_tag
        # A second run in the same process keys by its own place after the user's tag, not the first run's.
        again = key_compiled_graphs_by_rank(0, {**degrees, "tp": 1, "dp_shard": 4})
        assert again == "mine-rank0-pp1xdp_replicate1xdp_shard4xcp1xtp1"
    assert torch.compiler.config.cache_key_tag == before


def tiny_model(layers: int = 2) -> Transformer:
    torch.manual_seed(0)
    args = get_flavor("tiny")
    args.n_layers, args.max_seq_len = layers, 64
    return Transformer(args)


def saved_bytes(model: Transformer) -> int:
    """Bytes the forward keeps for backward (saved-tensor hooks see the compiled graphs' saves)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(torch.randint(0, 256, (4, 64)))
    out.float().pow(2).mean().backward()
    return total


def test_the_memory_budget_sets_what_compiled_blocks_keep():
    """0.0 recomputes the most, 1.0 nothing. The partitioner that applies the budget is inductor's
    (min-cut); aot_eager_decomp_partition runs it without generating kernels, which is quicker."""
    kept = {}
    try:
        for budget in (1.0, 0.0):
            torch._dynamo.reset()
            set_memory_budget(budget)
            model = tiny_model()
            model.apply_runtime(local_runtime(model, ac_mode="memory_budget", compile_backend="aot_eager_decomp_partition"))
            kept[budget] = saved_bytes(model)
    finally:
        set_memory_budget(1.0)
        torch._dynamo.reset()
    assert kept[0.0] < 0.5 * kept[1.0]


def test_fully_recomputed_blocks_compile_their_computation_and_checkpoint_outside():
    model = tiny_model()
    model.apply_runtime(local_runtime(model, ac_mode="selective", ac_option="2", compile_backend="eager"))
    recomputed, whole = model.layers["0"], model.layers["1"]
    assert recomputed.runtime.recompute is RECOMPUTE_ALL and recomputed.runtime.compile.scope == "compute"
    assert hasattr(recomputed._compiled_compute, "_torchdynamo_orig_callable")
    assert whole.runtime.recompute is None and whole.runtime.compile.scope == "block"
    assert whole._compiled_call_impl is not None and whole._compiled_compute is None
    assert "compute" not in vars(whole)


@pytest.mark.parametrize("args, message", [
    (["--activation_checkpoint.mode", "memory_budget"], "needs compile.enable with 'model' in compile.components; "
     "turn compile.enable on, or choose 'full' or 'selective'"),
    (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "--compile.components", "loss"],
     "add 'model' to compile.components, or choose"),
    (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "--compile.backend", "aot_eager"],
     "applied by inductor's partitioner, and compile.backend is 'aot_eager'; use 'inductor'"),
    (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "--activation_checkpoint.memory_budget",
      "1.5"], r"memory_budget: must be in \[0, 1\], got 1.5"),
    (["--compile.backend", "tvm"], "compile.backend"),
])
def test_compile_and_recompute_options_that_cannot_work_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def test_cuda_graphs_are_refused_on_the_cpu():
    config = load_config(["--compile.enable", "--compile.backend", "cudagraphs"])
    with pytest.raises(ConfigError, match="'cudagraphs' replays CUDA graphs, and this run is on the CPU"):
        check_device_options(config, "cpu")
    check_device_options(config, "cuda")
