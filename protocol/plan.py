"""A convergence test plan: its TOML model, its validation and its expansion into launches.

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
    overrides = { "model.flavor" = "tiny", "debug.deterministic" = true }

    [tolerance]            # protocol.tolerance.Tolerance: how a set is judged
    mode = "exact"

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

The keys of every table are listed, with their meaning, in `PLAN_KEYS`, `CONTROL_KEYS` and
`SET_KEYS` below; `[tolerance]` takes the fields of `protocol.tolerance.Tolerance`.

Overrides are trainer options written as dotted keys (`"section.key" = value`, or nested tables
`section = { key = value }`); each becomes `--section.key value` on the command line (booleans
`--section.key=true|false`, lists comma joined). Keys the plan itself sets (steps, batch, seed,
degrees, output, config, checkpoint loading) cannot be overridden: the error names the plan key
to use instead. Keys that shape the model or the data (`model.*`, `training.seq_len`,
`training.dataset`, `training.dataset_path`) belong in `[plan].overrides`, never in one run's.

Expansion
---------
`Plan.launches()` gives, in order: the seed checkpoint (one process), the control (repeated
`tolerance.control_repeats` times with seeds seed, seed+1, ... in statistical mode, named
`control`, `control-seed1`, ...), then the sets in file order, each once with `seed`. Every run's
dump folder is `<output>/<slug of its name>` (lower case, runs of other characters as `-`).

Validation
----------
`load_plan` checks the file (unknown keys with the closest valid name, types, required keys,
duplicate names), the plan rules (same local batch and DP degree, or same global batch; whole
nodes) and every launch exactly as the launcher would (`trainer.config.manager.load_config` and
`trainer.preflight.plan_run`: degrees vs world size, heads vs TP, seq_len vs TP/CP, layers vs
stages, microbatches vs schedule), and raises one `PlanError` listing every problem with its fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.tolerance import Tolerance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_NAME = "./torchrun_launch.sh"
BATCH_MODES = ("local", "global")
SET_KINDS = ("parallelism", "technique")
RDZV_PORT = 29500


class PlanError(ValueError):
    """A plan that cannot run as written; the message lists every problem and its fix."""


# ---------------------------------------------------------------------------------------------
# The schema: every key of every table, with its type and meaning


@dataclass(frozen=True)
class Key:
    kind: type
    doc: str
    required: bool = False
    default: Any = None


PLAN_KEYS: dict[str, Key] = {
    "name": Key(str, "Name of the plan, shown in reports.", required=True),
    "config": Key(str, "Base training config shared by every run: a path, or a bare name looked up in the current "
                       "directory, then in train_configs/ (as --job.config_file).", required=True),
    "output": Key(str, "Folder holding one dump folder per run; relative paths are relative to the current "
                       "directory. Default: outputs/protocol/<slug of name>."),
    "steps": Key(int, "Training steps of every run (training.steps).", required=True),
    "warmup_steps": Key(int, "Learning-rate warmup steps of every run (lr_scheduler.warmup_steps); default: the "
                             "base config's."),
    "local_batch_size": Key(int, "Rows per data-parallel rank per step (training.local_batch_size).", required=True),
    "dp_degree": Key(int, "N, the data-parallel degree (dp_replicate x dp_shard) of every run.", required=True),
    "batch": Key(str, "What stays fixed across runs: 'local' (default), the local batch and the DP degree; "
                      "'global', only the global batch local_batch_size x dp_degree (sets may then change "
                      "dp_shard and local_batch_size; gradient accumulation makes up the rest).", default="local"),
    "seed_checkpoint": Key(bool, "Create one step-0 seed checkpoint first and start every run from it "
                                 "(identical initial weights in every layout). Default true.", default=True),
    "seed": Key(int, "debug.seed of the runs (statistical repeats of the control add 1, 2, ...). Default 0.",
                default=0),
    "gpus_per_node": Key(int, "Processes (GPUs) per node: a run with more spans nproc / gpus_per_node whole "
                              "nodes. Default 8.", default=8),
    "overrides": Key(dict, "Trainer options common to every run, as dotted keys: { \"model.flavor\" = \"tiny\" }.",
                     default={}),
}

DEGREE_KEYS: dict[str, Key] = {
    "dp_replicate": Key(int, "Data-parallel replicas (HSDP/DDP); dp_shard defaults to dp_degree / dp_replicate. "
                             "Default 1.", default=1),
    "tp": Key(int, "Tensor-parallel degree. Default 1.", default=1),
    "cp": Key(int, "Context-parallel degree. Default 1.", default=1),
    "pp": Key(int, "Pipeline-parallel degree. Default 1.", default=1),
    "pp_schedule": Key(str, "Pipeline schedule (parallelism.pipeline_parallel_schedule); only with pp > 1. "
                            "Default: the base config's."),
}

CONTROL_KEYS: dict[str, Key] = {
    "name": Key(str, "Name of the control run. Default 'control'.", default="control"),
    "overrides": Key(dict, "Trainer options of the control only (dotted keys).", default={}),
    **DEGREE_KEYS,
}

SET_KEYS: dict[str, Key] = {
    "name": Key(str, "Name of the test set (unique; its slug names its dump folder).", required=True),
    "kind": Key(str, "'parallelism' (a layout given by the degree keys) or 'technique' (options given by "
                     "overrides, on the control's 1D layout unless degrees are given).", required=True),
    "overrides": Key(dict, "Trainer options of this set only (dotted keys).", default={}),
    **DEGREE_KEYS,
    "dp_shard": Key(int, "FSDP shard degree; default dp_degree / dp_replicate. With batch = 'local' it must keep "
                         "dp_replicate x dp_shard = dp_degree."),
    "local_batch_size": Key(int, "Local batch of this set; with batch = 'local' it must equal the plan's."),
}

TABLES = {"plan": PLAN_KEYS, "tolerance": None, "control": CONTROL_KEYS, "sets": SET_KEYS}

def describe_keys() -> str:
    """Every key of every plan table with its type and meaning: the reference for the docs."""
    lines = []
    for table, schema in TABLES.items():
        title = "[[sets]]" if table == "sets" else f"[{table}]"
        if schema is None:
            lines += ["", f"{title}: the fields of protocol.tolerance.Tolerance"]
            continue
        lines += ["", title]
        for key, spec in schema.items():
            need = "required" if spec.required else "optional"
            lines.append(f"  {key} ({type_word(spec.kind)}, {need}): {spec.doc}")
    return "\n".join(lines).strip()


# Options the plan sets itself, and the plan key to use instead.
PLAN_OWNED = {
    "job.config_file": "plan.config",
    "job.dump_folder": "plan.output",
    "training.steps": "plan.steps",
    "lr_scheduler.warmup_steps": "plan.warmup_steps",
    "training.local_batch_size": "plan.local_batch_size (or a set's local_batch_size with batch = 'global')",
    "training.global_batch_size": "plan.batch and plan.local_batch_size x plan.dp_degree",
    "debug.seed": "plan.seed",
    "checkpoint.create_seed_checkpoint": "plan.seed_checkpoint",
    "parallelism.data_parallel_replicate_degree": "the set's dp_replicate",
    "parallelism.data_parallel_shard_degree": "plan.dp_degree (or a set's dp_shard with batch = 'global')",
    "parallelism.tensor_parallel_degree": "the set's tp",
    "parallelism.context_parallel_degree": "the set's cp",
    "parallelism.pipeline_parallel_degree": "the set's pp",
    "parallelism.pipeline_parallel_schedule": "the set's pp_schedule",
}
SEED_OWNED = {"checkpoint.initial_load_path": "plan.seed_checkpoint", "checkpoint.load_only": "plan.seed_checkpoint"}
# Options that decide the model or the data: one value for every run, else nothing is comparable.
SHARED_PREFIXES = ("model.",)
SHARED_KEYS = ("training.seq_len", "training.dataset", "training.dataset_path")


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
    role: str  # "seed", "control" or "test"
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

    @property
    def slug(self) -> str:
        return slugify(self.name)

    def command(self) -> str:
        """The shell command that runs this launch from the repository root.

        One node: `NGPU=<nproc> ./torchrun_launch.sh ARGS` (the seed: one process, no NGPU). Several
        nodes: the torchrun rendezvous command to start on every node, with HEAD_NODE set to the
        first node's host name (or use the SLURM scripts, which do that).
        """
        args = shlex.join(self.args)
        if self.role == "seed":
            return f"{LAUNCHER_NAME} {args}"
        if self.nodes == 1:
            return f"NGPU={self.nproc} {LAUNCHER_NAME} {args}"
        return (f"PYTHONPATH=. python -m torch.distributed.run --nnodes {self.nodes} --nproc_per_node "
                f"{self.procs_per_node} --rdzv_backend c10d --rdzv_endpoint \"${{HEAD_NODE:?first node}}:{RDZV_PORT}\" "
                f"--rdzv_id {self.slug} -m trainer.train {args}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "kind": self.kind, "nproc": self.nproc, "nodes": self.nodes,
                "procs_per_node": self.procs_per_node, "degrees": dict(self.degrees), "seed": self.seed,
                "output": str(self.output), "args": list(self.args), "depends_on": list(self.depends_on),
                "command": self.command()}


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
    checkpoint_folder: str = "checkpoint"  # the base config's checkpoint.folder: where the seed lands
    default_pp_schedule: str = "1F1B"  # the base config's, for the degrees of runs that give none

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_degree

    @property
    def seed_checkpoint_path(self) -> Path | None:
        """The step-0 folder the seed run writes and every run loads."""
        if not self.seed_checkpoint:
            return None
        return self.output / slugify(SEED_NAME) / self.checkpoint_folder / "step-0"

    def control_names(self) -> list[str]:
        """The control, then its statistical repeats (`<name>-seed<seed>`)."""
        repeats = self.tolerance.control_repeats if self.tolerance.mode == "statistical" else 1
        return [self.control.name] + [f"{self.control.name}-seed{self.seed + i}" for i in range(1, max(repeats, 1))]

    def launches(self) -> list[Launch]:
        """Seed checkpoint (when enabled), control (and repeats), then the sets in file order."""
        launches = [seed_launch(self)] if self.seed_checkpoint else []
        for i, name in enumerate(self.control_names()):
            launches.append(run_launch(self, self.control, name, "control", self.seed + i))
        launches += [run_launch(self, spec, spec.name, "test", self.seed) for spec in self.sets]
        return launches


SEED_NAME = "seed"


def slugify(name: str) -> str:
    """A folder name from a run name: '3D FSDP+TP2+PP2' -> '3d-fsdp-tp2-pp2'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"


# ---------------------------------------------------------------------------------------------
# Expansion into launches


def common_args(plan: Plan, output: Path, seed: int) -> list[str]:
    """Options every launch shares: the config, the dump folder, the common overrides, the seed."""
    return ["--job.config_file", plan.config, "--job.dump_folder", str(output), *override_args(plan.overrides),
            "--debug.seed", str(seed)]


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


def run_args(plan: Plan, spec: RunSpec, output: Path, seed: int, with_seed: bool = True) -> list[str]:
    """The options of a control or test run; `with_seed=False` leaves out loading the seed
    checkpoint (which does not exist yet when the plan is validated)."""
    degrees = resolved_degrees(plan, spec)
    local = spec.local_batch_size or plan.local_batch_size
    global_batch = plan.global_batch_size if plan.batch == "global" else -1
    args = common_args(plan, output, seed)
    args += ["--training.steps", str(plan.steps)]
    if plan.warmup_steps is not None:
        args += ["--lr_scheduler.warmup_steps", str(plan.warmup_steps)]
    args += ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_batch)]
    args += layout_args(degrees, spec)
    args += override_args(spec.overrides)
    if with_seed and plan.seed_checkpoint_path is not None:
        args += ["--checkpoint.initial_load_path", str(plan.seed_checkpoint_path), "--checkpoint.load_only"]
    return args


def run_launch(plan: Plan, spec: RunSpec, name: str, role: str, seed: int) -> Launch:
    degrees = resolved_degrees(plan, spec)
    nproc = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["cp"] * degrees["pp"]
    per_node = min(nproc, plan.gpus_per_node)
    nodes = -(-nproc // plan.gpus_per_node)
    output = plan.output / slugify(name)
    kind = "control" if role == "control" else spec.kind
    return Launch(name=name, role=role, kind=kind, nproc=nproc, nodes=nodes, procs_per_node=per_node,
                  degrees=degrees, args=tuple(run_args(plan, spec, output, seed)), output=output, seed=seed,
                  seed_checkpoint=plan.seed_checkpoint_path,
                  depends_on=(SEED_NAME,) if plan.seed_checkpoint else (), overrides=dict(spec.overrides))


def option_value(value: Any) -> str:
    """A trainer option's value as written on the command line: true/false, lists comma joined."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def override_args(overrides: dict[str, Any]) -> list[str]:
    """Dotted keys to command-line options: --key value, booleans --key=true|false, lists a,b,c."""
    args = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            args.append(f"--{key}={option_value(value)}")
        elif isinstance(value, list):
            text = option_value(value)
            args += [f"--{key}={text}"] if not text else [f"--{key}", text]
        elif isinstance(value, str) and (value.startswith("-") or not value):
            args.append(f"--{key}={value}")  # a value that looks like an option, or nothing
        else:
            args += [f"--{key}", str(value)]
    return args


# ---------------------------------------------------------------------------------------------
# Reading the TOML: structure, types and the plan's own rules


def type_word(kind: type) -> str:
    return {int: "an integer", str: "a string", bool: "true or false", dict: "a table", float: "a number"}[kind]


def type_ok(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def read_table(data: Any, schema: dict[str, Key], where: str, problems: list[str]) -> dict[str, Any]:
    """Values of the keys that are known and well typed (others are reported)."""
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a table, got {data!r}")
        return {}
    values = {}
    for key, value in data.items():
        if key not in schema:
            problems.append(f"{where}.{key}: unknown key{closest(key, list(schema))} "
                            f"(valid: {', '.join(schema)})")
        elif not type_ok(value, schema[key].kind):
            problems.append(f"{where}.{key}: expected {type_word(schema[key].kind)}, got {value!r}")
        else:
            values[key] = value
    for key, spec in schema.items():
        if spec.required and key not in data:
            problems.append(f"{where}.{key}: missing (required): {spec.doc}")
    return values


def check_choice(values: dict, key: str, choices: tuple[str, ...], where: str, problems: list[str]) -> None:
    if key in values and values[key] not in choices:
        problems.append(f"{where}.{key}: {values[key]!r} is not one of {', '.join(map(repr, choices))}"
                        f"{closest(values[key], list(choices))}")
        del values[key]


def check_minimum(values: dict, key: str, minimum: int, where: str, problems: list[str]) -> None:
    if key in values and values[key] < minimum:
        problems.append(f"{where}.{key}: must be >= {minimum}, got {values[key]}")
        del values[key]


def flatten(overrides: dict, prefix: str = "") -> dict[str, Any]:
    """{"model": {"flavor": "tiny"}} and {"model.flavor": "tiny"} both give {"model.flavor": "tiny"}."""
    flat = {}
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def check_overrides(raw: dict, where: str, shared: bool, seed_checkpoint: bool, problems: list[str]) -> dict:
    """Known trainer keys with values of the right type, none the plan sets itself.

    `shared` is true for [plan].overrides: only there may the model and the data be chosen.
    """
    from trainer.config.manager import ConfigError, convert, field_types, sections

    known = sections()
    valid = {}
    for key, value in flatten(raw).items():
        at = f'{where}."{key}"'
        section, _, name = key.partition(".")
        if section not in known or not name:
            problems.append(f"{at}: not a trainer option; write it as \"section.key\" with section one of "
                            f"{', '.join(known)}{closest(section, list(known))}")
            continue
        types_ = field_types(known[section])
        if name not in types_:
            problems.append(f"{at}: unknown option {key}{closest(name, list(types_))}")
            continue
        owner = PLAN_OWNED.get(key) or (SEED_OWNED.get(key) if seed_checkpoint else None)
        if owner:
            problems.append(f"{at}: set by the plan; use {owner} instead")
            continue
        if not shared and (key.startswith(SHARED_PREFIXES) or key in SHARED_KEYS):
            problems.append(f"{at}: decides the model or the data, which must be the same in every run; "
                            "set it in plan.overrides")
            continue
        try:
            convert(value, types_[name], at)
        except ConfigError as e:
            problems.append(str(e))
            continue
        valid[key] = value
    return valid


def read_tolerance(data: Any, problems: list[str]) -> Tolerance:
    fields_ = {f.name: f for f in dataclasses.fields(Tolerance)}
    schema = {name: Key(type(f.default), "") for name, f in fields_.items()}
    values = read_table(data if data is not None else {}, schema, "tolerance", problems)
    values = {k: float(v) if schema[k].kind is float else v for k, v in values.items()}
    tolerance = Tolerance(**values)
    problems += tolerance.problems()
    return tolerance


def read_degrees(values: dict, where: str, problems: list[str]) -> None:
    from trainer.parallel.stages import SCHEDULES

    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "local_batch_size"):
        check_minimum(values, key, 1, where, problems)
    check_choice(values, "pp_schedule", SCHEDULES, where, problems)
    if "pp_schedule" in values and values.get("pp", 1) == 1:
        problems.append(f"{where}.pp_schedule: has no effect without pipeline parallelism; set {where}.pp >= 2 or "
                        "remove it")


def read_spec(data: Any, where: str, schema: dict[str, Key], seed_checkpoint: bool,
              problems: list[str]) -> RunSpec | None:
    """A control or set table as a RunSpec, or None when it has problems of its own."""
    before = len(problems)
    values = read_table(data, schema, where, problems)
    check_choice(values, "kind", SET_KINDS, where, problems)
    read_degrees(values, where, problems)
    overrides = check_overrides(values.pop("overrides", {}), f"{where}.overrides", False, seed_checkpoint, problems)
    if len(problems) > before:
        return None
    kind = values.pop("kind", "control")
    name = values.pop("name", "control")
    if kind == "technique" and not overrides:
        problems.append(f"{where}.overrides: a technique set needs the trainer options that turn the technique on, "
                        "e.g. { \"compile.enable\" = true }")
        return None
    return RunSpec(name=name, kind=kind, where=where, overrides=overrides, **values)


def read_plan_table(data: Any, problems: list[str]) -> dict[str, Any]:
    values = read_table(data, PLAN_KEYS, "plan", problems)
    for key, minimum in (("steps", 1), ("warmup_steps", 0), ("local_batch_size", 1), ("dp_degree", 1),
                         ("gpus_per_node", 1), ("seed", 0)):
        check_minimum(values, key, minimum, "plan", problems)
    check_choice(values, "batch", BATCH_MODES, "plan", problems)
    if "config" in values:
        from trainer.config.manager import TRAIN_CONFIGS_DIR, ConfigError, resolve_config_file

        try:
            path = resolve_config_file(values["config"])
            shipped = path.resolve().parent == TRAIN_CONFIGS_DIR.resolve()
            values["config"] = path.name if shipped else str(path.resolve())
        except ConfigError as e:
            problems.append(str(e).replace("job.config_file", "plan.config", 1))
            del values["config"]
    seed_checkpoint = values.get("seed_checkpoint", True)
    values["overrides"] = check_overrides(values.get("overrides", {}), "plan.overrides", True, seed_checkpoint,
                                          problems)
    return values


# ---------------------------------------------------------------------------------------------
# The plan's rules and the trainer's own checks of every launch


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


def node_problems(plan: Plan, launch: Launch, label: str) -> list[str]:
    if launch.nproc > plan.gpus_per_node and launch.nproc % plan.gpus_per_node:
        return [f"{label}: {launch.nproc} processes span more than one node but do not fill whole nodes of "
                f"plan.gpus_per_node = {plan.gpus_per_node}; use degrees whose product is a multiple of "
                f"{plan.gpus_per_node}, or change plan.gpus_per_node"]
    return []


def trainer_problems(argv: list[str], nproc: int | None, label: str) -> list[str]:
    """What the launcher's own checks (config loading, preflight) say about one launch."""
    from trainer.config.manager import ConfigError, load_config
    from trainer.preflight import plan_run

    try:
        config = load_config(argv)
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


def base_config(argv: list[str]):
    from trainer.config.manager import load_config

    return load_config(argv)


def launch_problems(plan: Plan) -> list[str]:
    """Plan rules and trainer checks of every distinct launch (control repeats differ only by seed)."""
    found = []
    for spec in (plan.control, *plan.sets):
        rules = batch_rule_problems(plan, spec)
        if spec.kind == "parallelism" and not rules and repeats_control(plan, spec):
            rules.append(f"{spec.where}: its layout and batch equal the control's, so it would test nothing; give "
                         "it a degree (tp, cp, pp, dp_replicate), or make it kind = 'technique' with overrides")
        found += rules
        if not rules:  # with broken degrees the trainer's checks would only repeat the rule
            found += spec_launch_problems(plan, spec)
    return found


def spec_launch_problems(plan: Plan, spec: RunSpec) -> list[str]:
    role = "control" if spec is plan.control else "test"
    launch = run_launch(plan, spec, spec.name, role, plan.seed)
    argv = run_args(plan, spec, launch.output, plan.seed, with_seed=False)
    return node_problems(plan, launch, spec.label) + trainer_problems(argv, launch.nproc, spec.label)


def name_problems(plan: Plan) -> list[str]:
    """Every run needs its own dump folder: names (as slugs) must differ."""
    found, seen = [], {}
    owners = ([(SEED_NAME, "the seed checkpoint run")] if plan.seed_checkpoint else [])
    owners += [(name, f"control ({name!r})") for name in plan.control_names()]
    owners += [(spec.name, spec.label) for spec in plan.sets]
    for name, label in owners:
        slug = slugify(name)
        if slug in seen:
            found.append(f"{label}: name {name!r} gives the output folder {slug!r}, as {seen[slug]} does; "
                         "give each run a name that differs in letters or digits")
        else:
            seen[slug] = label
    return found


# ---------------------------------------------------------------------------------------------
# Entry point


def load_plan(path: Path | str) -> Plan:
    """Read, validate and return a plan; raise PlanError listing every problem."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise PlanError(f"{path}: cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{path}: not valid TOML: {e}") from None
    problems: list[str] = []
    plan = build_plan(path, data, problems)
    if plan is not None:
        problems += name_problems(plan)
        problems += launch_problems(plan)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise PlanError(f"{path}: {len(problems)} problem{'s' if len(problems) > 1 else ''}:\n{listed}")
    logger.debug("plan %s: %d launches", plan.name, len(plan.launches()))
    return plan


def build_plan(path: Path, data: dict, problems: list[str]) -> Plan | None:
    """The Plan of a parsed TOML document, reporting every problem of its tables.

    Returns None when [plan] or [control] cannot be read (nothing else can be checked then); a
    set with problems of its own is left out of the plan so the others are still checked.
    """
    for table in data:
        if table not in TABLES:
            problems.append(f"[{table}]: unknown table{closest(table, list(TABLES))} (valid: {', '.join(TABLES)})")
    if "plan" not in data:
        problems.append("[plan]: missing; it names the base config, steps, local_batch_size and dp_degree")
    values = read_plan_table(data.get("plan", {}), problems) if "plan" in data else {}
    # A bad optional key falls back to its default; without a required one nothing else can be checked.
    plan_ok = all(key in values for key, spec in PLAN_KEYS.items() if spec.required)
    seed_checkpoint = values.get("seed_checkpoint", True)
    tolerance = read_tolerance(data.get("tolerance"), problems)
    control = read_spec(data.get("control", {}), "control", CONTROL_KEYS, seed_checkpoint, problems)
    sets = read_sets(data.get("sets"), seed_checkpoint, problems)
    if not plan_ok or control is None:
        return None
    return assemble(path, values, tolerance, control, sets, problems)


def read_sets(data: Any, seed_checkpoint: bool, problems: list[str]) -> list[RunSpec]:
    """The sets that can be read (the others are reported)."""
    if data is None:
        problems.append("sets: the plan has no test sets; add at least one [[sets]] table with name and kind")
        return []
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        problems.append("sets: expected an array of tables ([[sets]])")
        return []
    specs = [read_spec(item, f"sets[{i}]", SET_KEYS, seed_checkpoint, problems) for i, item in enumerate(data)]
    return [spec for spec in specs if spec is not None]


def assemble(path: Path, values: dict, tolerance: Tolerance, control: RunSpec, sets: list[RunSpec],
             problems: list[str]) -> Plan | None:
    """Read what the base config decides (checkpoint folder, default schedule) and build the Plan."""
    output = Path(values.pop("output", f"outputs/protocol/{slugify(values['name'])}")).expanduser()
    plan = Plan(path=path, output=output.absolute(), tolerance=tolerance, control=control, sets=tuple(sets),
                **values)
    argv = common_args(plan, plan.output / "base", plan.seed)
    found = trainer_problems(argv, None, "plan")
    if found:
        problems += found
        return None
    config = base_config(argv)
    return dataclasses.replace(plan, checkpoint_folder=config.checkpoint.folder,
                               default_pp_schedule=config.parallelism.pipeline_parallel_schedule)
