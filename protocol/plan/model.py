"""A convergence test plan: the model of a validated plan and its expansion into launches.

A plan compares test sets (N-D parallel layouts, or training techniques) with a trusted control
(1D FSDP). For the comparison to mean anything every run must see the same tokens per step, so
all runs share one base config, one step count, one local batch size and one data-parallel
degree N (`batch = "local"`), or at least one global batch (`batch = "global"`), and they start
from one seed checkpoint so their initial weights are identical.

Plan file format
----------------
::

    [plan]
    name = "cpu_smoke"
    config = "debug_model.toml"
    output = "outputs/protocol/cpu_smoke"
    steps = 20
    warmup_steps = 2
    local_batch_size = 4
    dp_degree = 2
    batch = "local"
    seed_checkpoint = true
    seed = 0
    gpus_per_node = 8
    checkpoint_interval = 10   # each run saves into its own folder; a rerun resumes from there
    overrides = { "model.flavor" = "tiny", "debug.deterministic" = true }

    [tolerance]            # protocol.plan.tolerance.Tolerance: how a set is judged
    mode = "exact"         # or "statistical" (noise controls, protocol.verdict.decision)

    [control]              # optional: 1D FSDP over dp_degree ranks by default
    name = "1D FSDP"

    [[sets]]
    name = "3D FSDP+TP2+PP2"
    kind = "parallelism"
    tp = 2
    pp = 2
    pp_schedule = "Interleaved1F1B"

    [[sets]]
    name = "compile"
    kind = "technique"
    overrides = { "compile.enable" = true }

    [[sets]]               # a positive control: a bug of known size the plan must catch
    name = "lr x1.05"
    kind = "technique"
    expect = "fail"
    overrides = { "optimizer.lr" = 3.15e-3 }

    [slurm.seed]           # optional: #SBATCH options of the seed job, and of the training jobs
    mem = "64G"

The keys of every table are listed, with their meaning, in `protocol.plan.schema`; reading and
validating a file is `protocol.plan.load.load_plan`. A plan may also judge its sets by a
`[criterion]` instead of the tolerance, stop runs early by `[[early_stop]]` rules
(protocol.plan.criteria) and search a sweep's points (`[[sweeps]]` with `search = "bisect"`:
protocol.plan.sweeps, protocol.plan.search).

Overrides are trainer options written as dotted keys (`"section.key" = value`, or nested tables
`section = { key = value }`); each becomes `--section.key value` on the command line (booleans
`--section.key=true|false`, lists comma joined).

Expansion
---------
`Plan.launches()` gives, in order: the seed checkpoint (one process), the control, in
statistical mode its `tolerance.noise_controls` noise controls (named `<control>-noise1`, ...:
the control's launch again), then the sets in file order. Every run has the same `debug.seed`,
so every run trains on the same data from the same initial weights. In statistical mode every run
(the control and the sets too) starts from those weights perturbed at rounding level,
`--debug.init_perturbation <tolerance.perturbation> --debug.init_perturbation_seed <s>` with `s`
drawn from the run's name: the control, its noise controls and a correct set are then
exchangeable draws of the same training, differing only in rounding. Every run's dump folder is
`<output>/<slug of its name>` (lower case, runs of other characters as `-`). Every training run
saves its own checkpoints there every `plan.checkpoint_interval` steps (save_args), so a run
started again after an interruption resumes from its newest one instead of from the seed.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.plan.criteria import Criterion, StopRule
from protocol.plan.options import override_args
from protocol.plan.schema import DEFAULT_CHECKPOINT_INTERVAL
from protocol.plan.sweeps import Sweep
from protocol.plan.tolerance import Tolerance

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_NAME = "./torchrun_launch.sh"
RDZV_PORT = 29500
SEED_NAME = "seed"
# Folders of plan.output that are not runs: the SLURM scripts and logs, and runs moved aside.
SLURM_DIR = "slurm"
SUPERSEDED_DIR = "superseded"
RESERVED_SLUGS = (SLURM_DIR, SUPERSEDED_DIR)
# In a run's folder: the protocol's claim on it, written before the run starts (protocol.run.folders).
RUN_MARKER = ".protocol-run"


# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class RunSpec:
    """The control or one test set, as written in the plan (degrees not yet resolved)."""

    name: str
    kind: str  # "control", "parallelism" or "technique"
    where: str  # the table it came from, for messages: "control", "sets[2]"
    overrides: dict[str, Any] = field(default_factory=dict)
    dp_replicate: int = 1
    dp_shard: int | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str | None = None
    local_batch_size: int | None = None
    expect: str = "pass"  # "fail": a positive control
    fingerprints: str = "evidence"  # "localize": its fingerprints say where it parts, and do not fail it
    sweep: str | None = None  # the name of the [[sweeps]] table it is a point of

    @property
    def label(self) -> str:
        return f"{self.where} ({self.name!r})"


@dataclass(frozen=True)
class Launch:
    """One process launch of the plan: what to start, on how many processes, with which options.

    `args` are the options for torchrun_launch.sh or `python -m trainer.train`; `overrides` are
    the trainer options of this run's own table (a technique set's technique), also in `args`;
    `output` is the run's dump folder; `seed_checkpoint` is the step-0 folder the seed run writes,
    or the one a run loads (None without a seed checkpoint); `depends_on` names the launches that
    must finish first.
    """

    name: str
    role: str  # "seed", "control", "noise" (a noise control) or "test"
    kind: str  # "seed", "control", "parallelism" or "technique"
    nproc: int
    nodes: int
    procs_per_node: int
    degrees: dict[str, Any]
    args: tuple[str, ...]
    output: Path
    seed: int = 0
    seed_checkpoint: Path | None = None
    depends_on: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    expect: str = "pass"
    sweep: str | None = None  # the sweep it is a point of
    search: bool = False  # a point of a searched sweep: `protocol run` runs it only when the search needs it

    @property
    def slug(self) -> str:
        return slugify(self.name)

    def command(self) -> str:
        """The shell command that runs this launch from the repository root.

        One node: `NGPU=<nproc> ./torchrun_launch.sh ARGS` (the seed: one process, no NGPU). Several
        nodes: the trainer's launcher joining a c10d rendezvous, to start on every node with
        HEAD_NODE set to the first node's host name (or use the SLURM scripts, which do that).
        """
        args = shlex.join(self.args)
        if self.role == "seed":
            return f"{LAUNCHER_NAME} {args}"
        if self.nodes == 1:
            return f"NGPU={self.nproc} {LAUNCHER_NAME} {args}"
        return (f"PYTHONPATH=. python -m trainer.launch --nproc {self.procs_per_node} --device cuda --nnodes "
                f"{self.nodes} --rdzv-endpoint \"${{HEAD_NODE:?first node}}:{RDZV_PORT}\" --rdzv-id {self.slug} {args}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "kind": self.kind, "nproc": self.nproc, "nodes": self.nodes,
                "procs_per_node": self.procs_per_node, "degrees": dict(self.degrees), "seed": self.seed,
                "output": str(self.output), "args": list(self.args), "depends_on": list(self.depends_on),
                "expect": self.expect, "sweep": self.sweep, "search": self.search, "command": self.command()}


@dataclass(frozen=True)
class SlurmJob:
    """What a plan sets for one kind of SLURM job (the seed, or the training runs): #SBATCH
    options, shell lines and srun options, and how a training job meets its time limit."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    mem: str | None = None
    cpus_per_task: int | None = None
    exclusive: bool = False
    extra: tuple[str, ...] = ()
    prologue: tuple[str, ...] = ()
    srun_options: tuple[str, ...] = ()
    device: str = "cuda"
    rdzv_port: int = RDZV_PORT
    save_before_limit: int = 120
    max_requeues: int = 10

    def sbatch_options(self) -> list[str]:
        """The options in the order the keys are listed, then the extra ones as written."""
        options = [f"--{key.replace('_', '-')}={getattr(self, key)}"
                   for key in ("partition", "account", "qos", "time", "mem", "cpus_per_task")
                   if getattr(self, key) is not None]
        return options + (["--exclusive"] if self.exclusive else []) + list(self.extra)


@dataclass(frozen=True)
class Plan:
    """A validated plan (see the module docstring for the file format)."""

    path: Path
    name: str
    config: str  # as given to --job.config_file: a shipped config's bare name, else an absolute path
    output: Path  # absolute
    steps: int
    local_batch_size: int
    dp_degree: int
    tolerance: Tolerance
    control: RunSpec
    sets: tuple[RunSpec, ...]
    warmup_steps: int | None = None
    batch: str = "local"
    seed_checkpoint: bool = True
    seed: int = 0
    gpus_per_node: int = 8
    overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
    checkpoint_folder: str = "checkpoint"  # the base config's checkpoint.folder: where the seed lands
    default_pp_schedule: str = "1F1B"  # the base config's, for the degrees of runs that give none
    slurm: dict[str, SlurmJob] = field(default_factory=dict)  # "seed" / "train" -> its #SBATCH options
    criterion: Criterion | None = None  # [criterion]: what judges every set, when given
    early_stop: tuple[StopRule, ...] = ()  # [[early_stop]]: when a set's run is stopped
    sweeps: tuple[Sweep, ...] = ()  # [[sweeps]], their sets' names in order

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_degree

    @property
    def seed_checkpoint_path(self) -> Path | None:
        """The step-0 folder the seed run writes and every run loads."""
        if not self.seed_checkpoint:
            return None
        return self.output / slugify(SEED_NAME) / self.checkpoint_folder / "step-0"

    def slurm_job(self, launch: Launch) -> SlurmJob:
        return self.slurm.get("seed" if launch.role == "seed" else "train", SlurmJob())

    def control_names(self) -> list[str]:
        return control_names(self.control.name, self.tolerance)

    def searched(self, spec: RunSpec) -> bool:
        """Whether the set is a point of a searched sweep (run only when the search needs it)."""
        return any(sweep.search and spec.name in sweep.points for sweep in self.sweeps)

    def launches(self) -> list[Launch]:
        """Seed checkpoint (when enabled), the control and its noise controls, then the sets in file order."""
        launches = [seed_launch(self)] if self.seed_checkpoint else []
        for i, name in enumerate(self.control_names()):
            launches.append(run_launch(self, self.control, name, "noise" if i else "control"))
        launches += [run_launch(self, spec, spec.name, "test") for spec in self.sets]
        return launches


def control_names(name: str, tolerance: Tolerance) -> list[str]:
    """The control, then (statistical mode) its noise controls `<name>-noise<k>`."""
    noise = tolerance.noise_controls if tolerance.mode == "statistical" else 0
    return [name] + [f"{name}-noise{k}" for k in range(1, noise + 1)]


def slugify(name: str) -> str:
    """A folder name from a run name: '3D FSDP+TP2+PP2' -> '3d-fsdp-tp2-pp2'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"


# ---------------------------------------------------------------------------------------------
# Expansion into launches


# What every training run of a plan records unless the plan says otherwise: per-module
# fingerprints, which the comparison uses to say where a set parts from the control.
RUN_DEFAULTS = {"metrics.fingerprints": True}
# Exact mode compares runs that must agree to float32 rounding: its runs compute in float32
# wherever they run ("auto" would be bfloat16 on a GPU). A plan that asks for a lower precision
# is refused (protocol.plan.checks.precision_problems).
EXACT_DEFAULTS = {"training.mixed_precision_param": "float32"}


def run_defaults(plan: "Plan") -> dict[str, Any]:
    return {**RUN_DEFAULTS, **(EXACT_DEFAULTS if plan.tolerance.mode == "exact" else {})}


def common_args(plan: Plan, output: Path, seed: int, own: dict[str, Any] | None = None,
                defaults: dict[str, Any] | None = None) -> list[str]:
    """Options every launch shares: the config, the dump folder, the overrides (`defaults`, over
    them the plan's, then a run's `own`, each key once), the seed."""
    return ["--job.config_file", plan.config, "--job.dump_folder", str(output),
            *override_args({**(defaults or {}), **plan.overrides, **(own or {})}), "--debug.seed", str(seed)]


def seed_launch(plan: Plan) -> Launch:
    output = plan.output / slugify(SEED_NAME)
    args = (*common_args(plan, output, plan.seed), "--checkpoint.create_seed_checkpoint")
    return Launch(name=SEED_NAME, role="seed", kind="seed", nproc=1, nodes=1, procs_per_node=1, degrees={},
                  args=args, output=output, seed=plan.seed, seed_checkpoint=plan.seed_checkpoint_path)


def resolved_degrees(plan: Plan, spec: RunSpec) -> dict[str, Any]:
    """dp_replicate, dp_shard, tp, cp, pp (and pp_schedule under PP) of a run."""
    shard = spec.dp_shard if spec.dp_shard is not None else max(plan.dp_degree // max(spec.dp_replicate, 1), 1)
    degrees: dict[str, Any] = {"dp_replicate": spec.dp_replicate, "dp_shard": shard, "tp": spec.tp, "cp": spec.cp,
                               "pp": spec.pp}
    if spec.pp > 1:
        degrees["pp_schedule"] = spec.pp_schedule or plan.default_pp_schedule
    return degrees


def layout_args(degrees: dict[str, Any], spec: RunSpec) -> list[str]:
    """Every degree is passed, so a base config's own degrees never leak into a run."""
    args = ["--parallelism.data_parallel_replicate_degree", str(degrees["dp_replicate"]),
            "--parallelism.data_parallel_shard_degree", str(degrees["dp_shard"]),
            "--parallelism.tensor_parallel_degree", str(degrees["tp"]),
            "--parallelism.context_parallel_degree", str(degrees["cp"]),
            "--parallelism.pipeline_parallel_degree", str(degrees["pp"])]
    if spec.pp_schedule:
        args += ["--parallelism.pipeline_parallel_schedule", spec.pp_schedule]
    return args


def perturbation_seed(name: str) -> int:
    """A run's own seed for its rounding-level perturbation: stable while its name is (editing
    other sets of the plan does not change it), different for every name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") & 0x7FFFFFFF


def run_args(plan: Plan, spec: RunSpec, output: Path, name: str | None = None, with_seed: bool = True) -> list[str]:
    """The options of the control, a noise control or a test set (`name`: the run's, when it is not
    the spec's); `with_seed=False` leaves out loading the seed checkpoint (which does not exist yet
    when the plan is validated)."""
    degrees = resolved_degrees(plan, spec)
    local = spec.local_batch_size or plan.local_batch_size
    global_batch = plan.global_batch_size if plan.batch == "global" else -1
    args = common_args(plan, output, plan.seed, spec.overrides, run_defaults(plan))
    args += ["--training.steps", str(plan.steps)]
    if plan.warmup_steps is not None:
        args += ["--lr_scheduler.warmup_steps", str(plan.warmup_steps)]
    args += ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_batch)]
    args += layout_args(degrees, spec)
    if plan.tolerance.mode == "statistical":
        args += ["--debug.init_perturbation", str(plan.tolerance.perturbation),
                 "--debug.init_perturbation_seed", str(perturbation_seed(name or spec.name))]
    args += save_args(plan)
    if with_seed and plan.seed_checkpoint_path is not None:
        args += ["--checkpoint.initial_load_path", str(plan.seed_checkpoint_path)]
    return args


def save_args(plan: Plan) -> list[str]:
    """Every training run saves into its own dump folder, so that an interrupted run resumes from
    its newest checkpoint (the trainer prefers those to initial_load_path, which it only reads).
    One checkpoint is kept: only the newest is ever resumed from. The last save is a full
    checkpoint in any case; its model-only export would be a second copy of the weights that no
    comparison reads."""
    return ["--checkpoint.enable=true", "--checkpoint.interval", str(plan.checkpoint_interval),
            "--checkpoint.keep_latest_k", "1", "--checkpoint.last_save_model_only=false"]


def run_launch(plan: Plan, spec: RunSpec, name: str, role: str) -> Launch:
    degrees = resolved_degrees(plan, spec)
    nproc = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["cp"] * degrees["pp"]
    per_node = min(nproc, plan.gpus_per_node)
    nodes = -(-nproc // plan.gpus_per_node)
    output = plan.output / slugify(name)
    kind = "control" if role in ("control", "noise") else spec.kind
    return Launch(name=name, role=role, kind=kind, nproc=nproc, nodes=nodes, procs_per_node=per_node,
                  degrees=degrees, args=tuple(run_args(plan, spec, output, name)), output=output,
                  seed=plan.seed, seed_checkpoint=plan.seed_checkpoint_path,
                  depends_on=(SEED_NAME,) if plan.seed_checkpoint else (), overrides=dict(spec.overrides),
                  expect=spec.expect, sweep=spec.sweep, search=role == "test" and plan.searched(spec))


def describe_degrees(degrees: dict) -> str:
    """'dp_shard 2, tp 2, pp 2 (Interleaved1F1B)': data-parallel sharding always, the rest when used."""
    if not degrees:
        return "1 process"
    parts = [f"{key} {degrees[key]}" for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp")
             if key == "dp_shard" or degrees.get(key, 1) != 1]
    if degrees.get("pp_schedule") and degrees.get("pp", 1) > 1:
        parts[-1] += f" ({degrees['pp_schedule']})"
    return ", ".join(parts)
