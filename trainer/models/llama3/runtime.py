"""How the model computes: one frozen description per block, built by `parallelize` and read by
the model's forward.

The parallelisms change how a block computes without changing its parameters or their names,
so checkpoints and Hugging Face interop are the same in every layout. Everything they change is
a field here, and nothing else changes it:

- the attention core: which sequence positions this rank holds and how it attends (causal SDPA
  over whole sequences, with document masking by an explicit mask or flex attention; or ring
  attention over the context-parallel group)
- recompute: what the block keeps for backward (activation checkpointing)
- compile: the block compiled whole, or its computation compiled inside an eager recompute
- sync: reduced-synchronization tensor parallelism's forward of the block
- the norm weights' gradient: summed over the tensor-parallel ranks in the reduce dtype
- local-shard weights: reduced sync's linear layers compute with their local shard
- the compute dtype the one-process model casts its weights to
- the pipeline stage's role (does it embed tokens, does it hold the output layer)

`Transformer.apply_runtime` installs a ModelRuntime; `describe()` prints it (the run's log
shows it as `runtime: ...` lines).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class Recompute:
    """Activation checkpointing of a block: `run(compute, *inputs)` runs `compute` keeping only
    what `name` says for backward."""

    name: str  # "all" (only the block's input is kept) or "cheap ops" (matmuls and attention kept)
    run: Callable


@dataclass(frozen=True)
class Compile:
    """torch.compile of a block: `scope` "block" compiles it whole (recompute policy inside);
    "compute" compiles its computation, which an eager full recompute then reruns in backward."""

    scope: str
    backend: str


@dataclass(frozen=True)
class NormWeights:
    """What a norm's weight passes through before use: `hook(weight)` (e.g. the tensor-parallel
    sum of its gradient in the reduce dtype); `name` says what it does."""

    name: str
    hook: Callable


@dataclass(frozen=True)
class BlockRuntime:
    """How one transformer block computes (see the module docstring)."""

    attention_core: object  # CausalAttention or a context-parallel core: positions() and __call__
    recompute: Recompute | None = None
    compile: Compile | None = None
    sync: object | None = None  # reduced sync: sync(block, carried, rope, documents) is the block's forward
    norm_weights: NormWeights | None = None  # both of the block's norms
    local_shard_weights: bool = False  # the linear layers compute with their local DTensor shard

    def describe(self) -> str:
        parts = [f"attention {describe_core(self.attention_core)}"]
        if self.recompute is not None:
            parts.append(f"recompute {self.recompute.name}")
        if self.compile is not None:
            parts.append(f"compiled ({'whole block' if self.compile.scope == 'block' else 'inside the recompute'}, "
                         f"{self.compile.backend})")
        if self.sync is not None:
            parts.append(f"sync {self.sync.describe()}")
        if self.local_shard_weights:
            parts.append("linear layers on their local shard")
        if self.norm_weights is not None:
            parts.append(f"norm weights: {self.norm_weights.name}")
        return "; ".join(parts)


@dataclass(frozen=True)
class ModelRuntime:
    """How a model (or one pipeline stage of it) computes: its blocks by name, and the layers
    around them."""

    blocks: tuple[tuple[str, BlockRuntime], ...]
    final_norm_weights: NormWeights | None = None
    compute_dtype: torch.dtype | None = None  # one process: every layer casts its weights to this
    embedding_output: Callable | None = None  # applied to the embedding's output (compiled blocks: a plain tensor)
    stage_role: str = "whole model"

    def with_blocks(self, **changes) -> "ModelRuntime":
        """A copy whose every block has `changes` (BlockRuntime fields)."""
        return replace(self, blocks=tuple((name, replace(rt, **changes)) for name, rt in self.blocks))

    def describe(self) -> list[str]:
        """One line for the model, then one per run of consecutive blocks that compute alike."""
        head = [self.stage_role]
        head.append(f"weights cast to {str(self.compute_dtype).removeprefix('torch.')}" if self.compute_dtype
                    else "weights as stored")
        if self.final_norm_weights is not None:
            head.append(f"final norm weight: {self.final_norm_weights.name}")
        if self.embedding_output is not None:
            head.append("embedding output made a plain tensor")
        lines = ["; ".join(head)]
        for names, text in _runs_of_alike_blocks(self.blocks):
            span = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
            lines.append(f"block{'s' if len(names) > 1 else ''} {span}: {text}")
        return lines


def describe_core(core) -> str:
    describe = getattr(core, "describe", None)
    return describe() if describe is not None else type(core).__name__


def _runs_of_alike_blocks(blocks) -> list[tuple[list[str], str]]:
    runs: list[tuple[list[str], str]] = []
    for name, runtime in blocks:
        text = runtime.describe()
        if runs and runs[-1][1] == text:
            runs[-1][0].append(name)
        else:
            runs.append(([name], text))
    return runs


def default_runtime(block_names, attention_core: Callable[[], object]) -> ModelRuntime:
    """Every block attending causally over whole sequences, nothing else changed."""
    return ModelRuntime(blocks=tuple((name, BlockRuntime(attention_core=attention_core())) for name in block_names))


__all__ = ["BlockRuntime", "Compile", "ModelRuntime", "NormWeights", "Recompute", "default_runtime"]
