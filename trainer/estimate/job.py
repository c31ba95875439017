"""The job the estimator runs: the config as estimated, and one fresh process per rank kind
(the fake world is process-wide state: process groups and device meshes cannot be re-created for
another rank in the same process).

The processes are forked from a server process that has imported torch and the estimator once
(multiprocessing's fork server, which this process keeps for its lifetime: trainer/forkserver.py):
each starts in milliseconds instead of importing torch again, 2-3 s of CPU a rank kind. Each gets this
process's environment, working folder and sys.path as they are when it is asked for (variables
read when torch is imported are those of the forkserver's start)."""

from __future__ import annotations

import logging
import os
import traceback
from concurrent.futures import ProcessPoolExecutor

from trainer import messages
from trainer.config.manager import ConfigError, load_config, with_default_config
from trainer.forkserver import preloaded_context
from trainer.version import installed_torch_version, torch_release


def estimated_config(overrides: list[str]):
    """The job's config as the estimator runs it: eager (compile off; the compiler's memory plan
    is not what eager allocates), and "auto" precision resolved as on CUDA (bfloat16)."""
    config = load_config(with_default_config(overrides))
    notes = []
    if config.compile.enable:
        config.compile.enable = False
        config.parallelism.enable_async_tensor_parallel = False
        notes.append("compile.enable is estimated in eager mode")
    if config.training.mixed_precision_param == "auto":
        config.training.mixed_precision_param = "bfloat16"
    if config.activation_checkpoint.mode == "memory_budget":
        notes.append(f"activation_checkpoint.mode memory_budget {config.activation_checkpoint.memory_budget:g} is "
                     "estimated between AC full (0) and none (1) at the budget, the share of the activations it lets "
                     "the compiler keep")
    notes += unseen(config)
    if config.training.enable_cpu_offload:
        raise ConfigError("training.enable_cpu_offload: the estimator does not model offloaded state; turn it off")
    return config, notes


def unseen(config) -> list[str]:
    """What the estimate (CPU kernels on fake tensors, this torch) leaves out of this job."""
    notes = []
    version = torch_version()
    if (release := torch_release(version)) is not None and release < (2, 13):
        notes.append(f"torch {version}: the optimizer step's temporaries over fake tensors may be counted high "
                     "(4.5x the parameter bytes with 2.11; about 1x with 2.13, as real runs allocate)")
    return notes + attention_unseen(config)


def torch_version() -> str:
    """The running torch's version without its local build (2.13.0, not 2.13.0+cpu)."""
    return (installed_torch_version() or "").split("+")[0]


def attention_unseen(config) -> list[str]:
    """What the CPU attention kernels of the estimate leave out of this job on CUDA."""
    from trainer.models.llama3.hf_config import configured_model_args
    from trainer.parallel.ring_pairs import TILE_ROWS

    if not config.training.document_masking:
        return []
    cp = config.parallelism.context_parallel_degree
    if cp > 1:
        chunk = config.training.seq_len // (2 * cp)
        return [f"not counted: on CUDA, ring attention's masked chunk pairs run a float32 math kernel a tile of "
                f"{TILE_ROWS} query rows at a time, a few local batch x heads x {TILE_ROWS} x {chunk} float32 "
                "tensors at once, where the CPU kernel estimated here holds the tile's mask"]
    args = configured_model_args(config.model)
    if args.kv_heads == args.n_heads:
        return []
    copies = args.n_heads // args.kv_heads
    return [f"not counted: on CUDA, masked grouped-query attention repeats the K/V heads {copies}x before its kernel "
            f"(grouped_query_attention), which backward keeps: {copies}x the keys' and values' bytes per layer"]


# What the forkserver imports once, so that no estimate's process imports it again.
PRELOADED = ["trainer.estimate.job", "trainer.estimate.rank", "trainer.preflight.checks"]


def estimate_kinds(overrides: list[str], nproc: int, kinds: list, steps: int) -> list:
    """The estimates of `kinds`, each in its own process, two at a time. The compiler's memory
    budget (activation_checkpoint.mode memory_budget, which eager code cannot run) bounds the
    activations it keeps to that share of the way from full checkpointing to none: estimated as
    both, and placed there (`at_budget`)."""
    ac = estimated_config(overrides)[0].activation_checkpoint
    if ac.mode == "memory_budget":
        full, none = (estimate_eager(overrides + ["--activation_checkpoint.mode", mode], nproc, kinds, steps)
                      for mode in ("full", "none"))
        return [at_budget(f, n, ac.memory_budget) for f, n in zip(full, none)]
    return estimate_eager(overrides, nproc, kinds, steps)


def at_budget(full, none, budget: float):
    """A rank's estimate `budget` of the way from its full-checkpointing one to its no-checkpointing one."""
    from dataclasses import replace

    from trainer.estimate.step_memory import MemoryBreakdown

    def between(a: MemoryBreakdown, b: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(**{name: round(getattr(a, name) + budget * (getattr(b, name) - getattr(a, name)))
                                  for name in ("parameters", "gradients", "optimizer", "activations", "temporaries")})

    return replace(none, step_peak=between(full.step_peak, none.step_peak), seconds=full.seconds + none.seconds)


def estimate_eager(overrides: list[str], nproc: int, kinds: list, steps: int) -> list:
    """The estimates of `kinds` as eager code runs, each in its own process, two at a time."""
    workers = max(1, min(len(kinds), os.cpu_count() or 1, 2))
    environment = dict(os.environ)
    with ProcessPoolExecutor(max_workers=workers, mp_context=preloaded_context(PRELOADED),
                             max_tasks_per_child=1) as pool:
        return list(pool.map(_estimate_one, [overrides] * len(kinds), [nproc] * len(kinds), kinds,
                             [steps] * len(kinds), [environment] * len(kinds)))


def _estimate_one(overrides: list[str], nproc: int, kind, steps: int, environment: dict[str, str]):
    """In a fresh process: the fake world is process-wide state."""
    from trainer.estimate.rank import estimate_rank
    from trainer.preflight.checks import plan_layout

    os.environ.clear()  # the forkserver's is this process's when it started it; the estimate's is now's
    os.environ.update(environment)
    # The parent loaded the same configuration and printed what it warned of: only errors here.
    messages.configure(level=logging.ERROR)
    config, _ = estimated_config(overrides)
    try:
        return estimate_rank(config, plan_layout(config, nproc), kind, steps)
    except Exception as e:  # torch's errors do not always pickle back to the parent: send the text
        raise EstimateError(f"{kind.name} (rank {kind.rank}): {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()}") from None


class EstimateError(RuntimeError):
    """A rank's estimate failed; the message holds its traceback."""


