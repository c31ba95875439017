"""For a rank that does not fit: changes to the job that would lower its peak, each estimated
again, so the advice says which of them fit instead of guessing."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.manager import ConfigError


@dataclass(frozen=True)
class Change:
    description: str
    overrides: tuple[str, ...]  # added after the job's own
    nproc: int


@dataclass(frozen=True)
class Tried:
    change: Change
    peak: int | None  # the largest peak over the rank kinds; None when the job cannot run so
    fits: bool
    reason: str = ""  # why it cannot run (the config check's message)


def candidate_changes(config, plan, nproc: int) -> list[Change]:
    """The usual remedies, least disruptive first; the global batch is kept."""
    c, p = config, config.parallelism
    keep_batch = ("--training.global_batch_size", str(plan.global_batch_size))
    changes = []
    if c.activation_checkpoint.mode != "full":
        changes.append(Change('activation_checkpoint.mode = "full"', ("--activation_checkpoint.mode", "full"), nproc))
    if c.training.local_batch_size > 1:
        half = c.training.local_batch_size // 2
        changes.append(Change(f"training.local_batch_size = {half} (the global batch kept by accumulation)",
                              ("--training.local_batch_size", str(half), *keep_batch), nproc))
    if plan.dims.pp > 1 and p.fsdp_reshard_after_forward != "always":
        changes.append(Change('parallelism.fsdp_reshard_after_forward = "always" (weights freed between forward and '
                              'backward under PP)', ("--parallelism.fsdp_reshard_after_forward", "always"), nproc))
    shard = ("--parallelism.data_parallel_shard_degree", str(2 * plan.dims.dp_shard))
    rows_per_pass = 2 * c.training.local_batch_size * plan.dims.dp
    if plan.global_batch_size % rows_per_pass == 0:
        changes.append(Change(f"twice the ranks, {2 * nproc} (FSDP over {2 * plan.dims.dp_shard})",
                              (*shard, *keep_batch), 2 * nproc))
    else:  # the global batch cannot be kept: one local batch per rank, twice as many rows
        changes.append(Change(f"twice the ranks, {2 * nproc} (FSDP over {2 * plan.dims.dp_shard}; global batch "
                              f"{rows_per_pass})", (*shard, "--training.global_batch_size", str(rows_per_pass)),
                              2 * nproc))
    return changes


def try_changes(overrides: list[str], config, plan, nproc: int, steps: int, usable_bytes: int) -> list[Tried]:
    """Each candidate change estimated (all rank kinds), in order."""
    from trainer.estimate.job import estimate_kinds, estimated_config
    from trainer.estimate.rank import rank_kinds
    from trainer.parallel.dims import stage_plan
    from trainer.preflight.checks import plan_layout

    tried = []
    for change in candidate_changes(config, plan, nproc):
        changed = [*overrides, *change.overrides]
        try:
            changed_config, _ = estimated_config(changed)
            changed_plan = plan_layout(changed_config, change.nproc)
        except ConfigError as e:
            tried.append(Tried(change, None, False, str(e).splitlines()[-1].strip()))
            continue
        kinds = rank_kinds(changed_plan.dims, stage_plan(changed_config, changed_plan.dims))
        peak = max(e.peak for e in estimate_kinds(changed, change.nproc, kinds, steps))
        tried.append(Tried(change, peak, peak <= usable_bytes))
    return tried
