"""The plan's own rules and the trainer's checks of every launch.

Each check returns the problems it finds (one message each, naming the table and what would be
valid) and never stops the others: `protocol.plan.load.load_plan` runs every check that can run
on what could be read, so a plan with independent mistakes gets them all listed at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from protocol.plan.model import (RESERVED_SLUGS, SEED_NAME, Plan, RunSpec, resolved_degrees, run_args,
                                 run_launch, slugify)
from protocol.plan.schema import TECHNIQUE_ONLY


def batch_rule_problems(plan: Plan, spec: RunSpec) -> list[str]:
    """Tokens per step must not change between runs: the point of the protocol."""
    found = []
    n, where = plan.dp_degree, spec.where
    if plan.batch == "local":
        if n % spec.dp_replicate:
            found.append(f"{where}.dp_replicate: {spec.dp_replicate} does not divide plan.dp_degree = {n}; "
                         f"use a divisor of {n}")
        elif spec.dp_shard is not None and spec.dp_replicate * spec.dp_shard != n:
            found.append(f"{where}.dp_shard: dp_replicate {spec.dp_replicate} x dp_shard {spec.dp_shard} gives DP "
                         f"degree {spec.dp_replicate * spec.dp_shard}, but batch = 'local' fixes it at "
                         f"plan.dp_degree = {n}; remove dp_shard, or set plan.batch = 'global'")
        if spec.local_batch_size is not None and spec.local_batch_size != plan.local_batch_size:
            found.append(f"{where}.local_batch_size: {spec.local_batch_size} differs from plan.local_batch_size = "
                         f"{plan.local_batch_size}, which batch = 'local' fixes for every run; remove it, or set "
                         "plan.batch = 'global'")
        return found
    if spec.dp_shard is None and n % spec.dp_replicate:
        found.append(f"{where}.dp_shard: needed because dp_replicate {spec.dp_replicate} does not divide "
                     f"plan.dp_degree = {n}")
        return found
    degrees = resolved_degrees(plan, spec)
    per_pass = (spec.local_batch_size or plan.local_batch_size) * degrees["dp_replicate"] * degrees["dp_shard"]
    if plan.global_batch_size % per_pass:
        found.append(f"{where}: local batch x DP degree = {per_pass} does not divide the global batch "
                     f"{plan.global_batch_size} (plan.local_batch_size x plan.dp_degree); change its "
                     "local_batch_size or dp_shard")
    return found


def repeats_control(plan: Plan, spec: RunSpec) -> bool:
    """A parallelism set whose layout and batch equal the control's tests nothing."""
    mine = (resolved_degrees(plan, spec), spec.local_batch_size or plan.local_batch_size, spec.overrides)
    control = (resolved_degrees(plan, plan.control), plan.local_batch_size, plan.control.overrides)
    return mine == control


def node_problems(plan: Plan, nproc: int, label: str) -> list[str]:
    if nproc > plan.gpus_per_node and nproc % plan.gpus_per_node:
        return [f"{label}: {nproc} processes span more than one node but do not fill whole nodes of "
                f"plan.gpus_per_node = {plan.gpus_per_node}; use degrees whose product is a multiple of "
                f"{plan.gpus_per_node}, or change plan.gpus_per_node"]
    return []


LOW_PRECISION = ("bfloat16", "float16")


def precision_problems(config, label: str, mode: str) -> list[str]:
    """Exact mode judges runs that agree to float32 rounding (1e-4 in the loss): a run computing
    in bfloat16 or float16 differs from the control by its rounding from the first step, so its
    verdict would say nothing about the layout."""
    if mode != "exact":
        return []
    settings = {"training.mixed_precision_param": config.training.mixed_precision_param,
                "training.dtype": config.training.dtype}
    low = {key: value for key, value in settings.items() if value in LOW_PRECISION}
    if not low:
        return []
    named = " and ".join(f"{key} = {value!r}" for key, value in low.items())
    return [f"{label}: {named}: [tolerance] mode = \"exact\" needs float32 compute, where correct layouts agree to "
            f"rounding (1e-4); in {next(iter(low.values()))} they differ by far more from the first step. Set mode = "
            "\"statistical\" (noise controls measure that rounding), or compute in float32"]


def trainer_problems(argv: list[str], nproc: int | None, label: str, mode: str = "statistical") -> list[str]:
    """What the launcher's own checks (config loading, preflight) say about one launch, and
    whether its precision suits the plan's tolerance mode."""
    from trainer.config.manager import ConfigError, load_config
    from trainer.preflight.checks import plan_run

    try:
        config = load_config(argv)
        precision = precision_problems(config, label, mode)
        if precision:
            return precision
        if nproc is not None:
            plan_run(config, nproc)
    except ConfigError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].endswith(":"):
            layout = re.fullmatch(r"parallel layout (\(.*\)) does not fit this job:", lines[0])
            head = f"{label} {layout.group(1)}" if layout else f"{label}: {lines[0][:-1]}"
            return [f"{head}: {line}" for line in lines[1:]]
        return [f"{label}: {' '.join(lines)}"]
    return []


def spec_problems(plan: Plan, spec: RunSpec, clean: bool) -> list[str]:
    """The batch rules, then (when they hold) the trainer's checks of this run's launch.

    `clean` is false when the table had problems of its own: a set that looks like the control
    may then only have a misspelled degree, so that rule waits until the table is fixed.
    """
    rules = batch_rule_problems(plan, spec)
    if clean and spec.kind == "parallelism" and not rules and repeats_control(plan, spec):
        rules.append(f"{spec.where}: its layout and batch equal the control's, so it would test nothing; give "
                     "it a degree (tp, cp, pp, dp_replicate), or make it kind = 'technique' with overrides")
    if spec.kind == "parallelism":
        rules += [f"{spec.where}.overrides.\"{key}\": changes the model, so the set is a technique, not a layout; "
                  "make it kind = 'technique'" for key, default in TECHNIQUE_ONLY.items()
                  if spec.overrides.get(key, default) != default]
    if rules:  # with broken degrees the trainer's checks would only repeat the rule
        return rules
    role = "control" if spec is plan.control else "test"
    launch = run_launch(plan, spec, spec.name, role)
    argv = run_args(plan, spec, launch.output, with_seed=False)
    return node_problems(plan, launch.nproc, spec.label) + trainer_problems(argv, launch.nproc, spec.label,
                                                                            plan.tolerance.mode)


def name_problems(names: Sequence[tuple[str, str]]) -> list[str]:
    """Every run needs its own dump folder: names (as slugs) must differ, and must not be one of
    the folders the protocol keeps beside the runs. `names` holds (name, label) pairs."""
    found, seen = [], {}
    for name, label in names:
        slug = slugify(name)
        if slug in RESERVED_SLUGS:
            found.append(f"{label}: name {name!r} gives the output folder {slug!r}, which the protocol keeps for "
                         f"{'the SLURM scripts' if slug == RESERVED_SLUGS[0] else 'runs moved aside'}; choose "
                         "another name")
        elif slug in seen:
            found.append(f"{label}: name {name!r} gives the output folder {slug!r}, as {seen[slug]} does; "
                         "give each run a name that differs in letters or digits")
        else:
            seen[slug] = label
    return found


def run_names(seed_checkpoint: bool, control_names: list[str], sets: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(name, label) of every run in launch order: the seed, the control and its repeats, the sets."""
    owners = [(SEED_NAME, "the seed checkpoint run")] if seed_checkpoint else []
    owners += [(name, f"control ({name!r})") for name in control_names]
    return owners + list(sets)
