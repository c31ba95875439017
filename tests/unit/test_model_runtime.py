"""The model's runtime (trainer/models/llama3/runtime.py): one frozen description of how each block
computes, built by `parallelize`, installed by the model and printed; nothing outside
trainer/models/ changes how the model's modules compute."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.models.llama3 import Transformer, get_flavor
from trainer.models.llama3.model import CausalAttention, Linear
from trainer.models.llama3.runtime import BlockRuntime, ModelRuntime, NormWeights
from trainer.parallel import local_runtime, model_runtime
from trainer.parallel.activation_checkpointing import RECOMPUTE_ALL, RECOMPUTE_CHEAP_OPS, apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.pipeline import split_into_stages
from trainer.parallel.stages import plan_stages

REPO = Path(__file__).resolve().parents[2]
# What the model's own code sets on its modules to change how they compute (runtime.py installs
# them), and the modules a pipeline stage drops.
MODEL_INTERNALS = {"core", "document_kernel", "recompute", "compute", "sync", "weight_hook", "compute_dtype",
                   "block_probe", "embeds_tokens", "local_shard", "runtime", "_compiled_compute", "stage_role",
                   "tok_embeddings", "norm", "output", "__class__"}


def tiny(n_layers: int = 4) -> Transformer:
    args = get_flavor("tiny")
    args.n_layers, args.max_seq_len = n_layers, 32
    return Transformer(args)


def assignments_outside_the_model(root: Path) -> list[str]:
    """`x.attr = ...` (or augmented, or `del x.layers[...]`) on a model internal, where x is not
    `self`, in the trainer's modules outside trainer/models/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "models" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr in MODEL_INTERNALS
                        and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))):
                    found.append(f"{path.relative_to(root)}:{target.lineno}: .{target.attr}")
                if (isinstance(node, ast.Delete) and isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Attribute) and target.value.attr == "layers"):
                    found.append(f"{path.relative_to(root)}:{target.lineno}: del .layers[...]")
    return sorted(found)


def test_nothing_outside_the_model_sets_how_its_modules_compute():
    assert assignments_outside_the_model(REPO / "trainer") == []


def test_the_guard_finds_an_assignment_from_outside(tmp_path):
    """The check above can fail: a parallelism that set an attention core from outside is found."""
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "cp.py").write_text("def apply(model, core):\n    for b in model.layers.values():\n"
                                                 "        b.attention.core = core\n    del model.layers['3']\n")
    assert assignments_outside_the_model(tmp_path) == ["parallel/cp.py:3: .core", "parallel/cp.py:4: del .layers[...]"]


def test_a_new_model_attends_causally_and_describes_itself():
    model = tiny()
    assert model.describe() == ["whole model; weights as stored",
                                "blocks 0-3: attention causal SDPA over whole sequences, documents by mask"]
    assert all(isinstance(block.attention.core, CausalAttention) for block in model.layers.values())


def test_recompute_and_compile_per_block_are_in_the_runtime_and_its_description():
    model = tiny()
    model.apply_runtime(local_runtime(model, ac_mode="selective", ac_option="2", compile_backend="eager",
                                      document_kernel="flex", compute_dtype=torch.bfloat16))
    runtime = model.runtime
    assert dataclasses.is_dataclass(runtime) and runtime.__dataclass_params__.frozen
    assert [rt.recompute for _, rt in runtime.blocks] == [RECOMPUTE_ALL, None, RECOMPUTE_ALL, None]
    assert [rt.compile.scope for _, rt in runtime.blocks] == ["compute", "block", "compute", "block"]
    assert model.describe() == [
        "whole model; weights cast to bfloat16; embedding output made a plain tensor",
        "block 0: attention causal SDPA over whole sequences, documents by flex; recompute all; "
        "compiled (inside the recompute, eager)",
        "block 1: attention causal SDPA over whole sequences, documents by flex; compiled (whole block, eager)",
        "block 2: attention causal SDPA over whole sequences, documents by flex; recompute all; "
        "compiled (inside the recompute, eager)",
        "block 3: attention causal SDPA over whole sequences, documents by flex; compiled (whole block, eager)",
    ]
    # What the model's modules compute with follows the runtime.
    assert {m.compute_dtype for m in model.modules() if hasattr(m, "compute_dtype")} == {torch.bfloat16}
    assert model.layers["1"].attention.core.document_kernel == "flex"
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.compute_dtype = None


def test_op_level_recompute_and_the_tensor_parallel_parts_are_described():
    model = tiny(2)
    recompute = apply_ac(model, "selective", "op")
    summed = NormWeights("TP gradient sum in float32", lambda weight: weight)

    @dataclasses.dataclass
    class Parts:  # what apply_tp returns (TensorParallelParts), without a TP mesh
        norm_weights = summed
        final_norm_weights = summed
        syncs = None
        local_shard_weights = False

    runtime = model_runtime(model, "mask", Parts(), None, recompute, apply_compile(recompute, "inductor"), None)
    assert {rt.recompute for _, rt in runtime.blocks} == {RECOMPUTE_CHEAP_OPS}
    assert runtime.describe() == [
        "whole model; weights as stored; final norm weight: TP gradient sum in float32; "
        "embedding output made a plain tensor",
        "blocks 0-1: attention causal SDPA over whole sequences, documents by mask; recompute cheap ops; "
        "compiled (whole block, inductor); norm weights: TP gradient sum in float32",
    ]
    model.apply_runtime(dataclasses.replace(runtime, blocks=tuple(
        (name, dataclasses.replace(rt, compile=None)) for name, rt in runtime.blocks)))
    assert model.norm.weight_hook is summed.hook and model.layers["0"].ffn_norm.weight_hook is summed.hook


def test_pipeline_stages_know_their_role_and_keep_their_blocks():
    stages = split_into_stages(tiny(), plan_stages(4, 2, "1F1B", None, 0, 0), pp_rank=1)
    stage = stages[1]
    assert list(stage.layers) == ["2", "3"] and stage.tok_embeddings is None and stage.output is not None
    assert stage.describe()[0].startswith("last pipeline stage")
    assert [name for name, _ in stage.runtime.blocks] == ["2", "3"]
    first = split_into_stages(tiny(), plan_stages(4, 2, "1F1B", None, 0, 0), pp_rank=0)[0]
    assert first.embeds_tokens and first.norm is None and first.describe()[0].startswith("first pipeline stage")


def test_a_runtime_for_other_blocks_is_refused():
    model = tiny(2)
    with pytest.raises(ValueError, match="runtime for blocks"):
        model.apply_runtime(ModelRuntime(blocks=(("0", BlockRuntime(CausalAttention())),)))


def test_a_compiled_block_keeps_its_runtime():
    model = tiny(1)
    model.apply_runtime(local_runtime(model, compile_backend="eager"))
    with pytest.raises(RuntimeError, match="compiled block"):
        model.apply_runtime(local_runtime(model))


def test_a_local_shard_linear_keeps_the_compute_dtype(one_rank_mesh):
    """Reduced sync's linear layers compute with their local shard; a compute dtype still casts it
    (a class swap used to drop the cast)."""
    linear = Linear(4, 3, bias=False)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = torch.nn.functional.linear(x, linear.weight.detach().bfloat16())
    linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), one_rank_mesh, [Shard(0)]))
    linear.local_shard, linear.compute_dtype = True, torch.bfloat16
    out = linear(x)
    assert type(out) is torch.Tensor and out.dtype == torch.bfloat16 and torch.equal(out, expected)
