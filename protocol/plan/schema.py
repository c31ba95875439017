"""The plan file's schema: every key of every table with its type and meaning, the trainer options
the plan owns, and the functions that read a TOML table against a schema.

Reading a table never stops at the first problem: each function appends what is wrong (naming the
key and what would be valid) to a `problems` list and keeps the values that are right, so one
pass over a plan lists every problem it has.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from protocol.plan.text import short

BATCH_MODES = ("local", "global")
SET_KINDS = ("parallelism", "technique")
EXPECTATIONS = ("pass", "fail")
FINGERPRINT_ROLES = ("evidence", "localize")
# A save every 250 steps: an 8B run of a few thousand steps loses at most a few hundred steps to an
# interruption, for about a dozen saves.
DEFAULT_CHECKPOINT_INTERVAL = 250
SLURM_KINDS = ("seed", "train")


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
    "seed": Key(int, "debug.seed of every run: the same data and initial weights in every run (noise controls "
                     "differ by a perturbation of their weights, not by their seed). Default 0.", default=0),
    "gpus_per_node": Key(int, "Processes (GPUs) per node: a run with more spans nproc / gpus_per_node whole "
                              "nodes. Default 8.", default=8),
    "overrides": Key(dict, "Trainer options common to every run, as dotted keys: { \"model.flavor\" = \"tiny\" }.",
                     default={}),
    "checkpoint_interval": Key(int, "Every training run saves a checkpoint into its own folder every this many "
                                    "steps (checkpoint.interval; the trainer also saves the last step), keeping "
                                    "only the newest; an interrupted `protocol run` resumes each unfinished run "
                                    f"from it. Default {DEFAULT_CHECKPOINT_INTERVAL}.",
                               default=DEFAULT_CHECKPOINT_INTERVAL),
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
    "expect": Key(str, "'pass' (default) or 'fail': a positive control, a set with a bug of known size (e.g. "
                       "optimizer.lr 5% off) that the plan must catch; if it passes, the plan is INCONCLUSIVE.",
                  default="pass"),
    "fingerprints": Key(str, "'evidence' (default): fingerprints that part from the control's fail the set, even "
                             "when its curves pass. 'localize': they only say where the set parts, and its curves "
                             "judge it: for a technique that changes the numbers on purpose (float8 linear layers "
                             "round every matmul operand), whose step-1 gradients differ by design.",
                        default="evidence"),
}
SWEEP_KEYS: dict[str, Key] = {
    "name": Key(str, "Beginning of the sets' names: each point of the grid is a set named '<name> key=value ...' "
                     "(the last part of each dotted key, in the grid's order).", required=True),
    "grid": Key(dict, "Trainer options and the values to sweep, as dotted keys: { \"optimizer.lr\" = [1e-3, "
                      "2e-3], \"optimizer.weight_decay\" = [0.0, 0.1] }; every combination is one set. "
                      "A sweep has a grid or points."),
    "points": Key(tuple, "Instead of a grid: an ordered array of tables of trainer options, one set per table: "
                        "[{ \"a.b\" = 1 }, { \"a.b\" = 2, \"a.c\" = 3 }]."),
    "search": Key(str, "'bisect': run only the points a bisection for the last point (in the written order, most "
                       "communication first) that meets [criterion] needs; needs [criterion] and a one-key grid "
                       "or points."),
    **{key: spec for key, spec in SET_KEYS.items() if key != "name"},
}
SEARCHES = ("bisect",)
# The metrics a criterion or an early-stop rule reads from metrics.jsonl: the validation loss
# (records with "kind": "validation") and the training loss (records without "kind").
METRICS = ("validation/loss", "loss")
CRITERION_KEYS: dict[str, Key] = {
    "metric": Key(str, "What judges a set: 'validation/loss' (the validation loss at `step`) or 'loss' (the mean "
                       "training loss over the `window` steps ending at `step`).", required=True),
    "step": Key(int, "The step the metric is read at. Default: plan.steps (the last step, where the trainer always "
                     "validates)."),
    "window": Key(int, "metric = 'loss' only (required there): how many steps, ending at `step`, the training loss "
                       "is averaged over."),
    "max": Key(float, "Absolute criterion: a set meets it when its metric <= max. Give one of max, "
                      "max_vs_control and max_sigmas_above_control."),
    "max_vs_control": Key(float, "Relative criterion: a set meets it when its metric <= the control's value of the "
                                 "same metric x max_vs_control (1.02: at most 2% above the control)."),
    "max_sigmas_above_control": Key(float, "Criterion in noise units: a set meets it when its metric <= the "
                                           "control's value + this many sigma, sigma the noise SD of the metric "
                                           "for one more run of the control family (statistical mode only)."),
}
EARLY_STOP_KEYS: dict[str, Key] = {
    "step": Key(int, "The step at which the rule is checked (once the run has logged the metric there).",
                required=True),
    "metric": Key(str, "'validation/loss' or 'loss' (training loss, averaged over `window` steps ending at `step`).",
                  required=True),
    "above": Key(float, "The run is stopped when its metric at `step` is above this.", required=True),
    "window": Key(int, "metric = 'loss' only (required there): steps averaged, ending at `step`."),
}
# The keys of a set or the control that decide its layout and batch.
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "pp_schedule", "local_batch_size")

SLURM_JOB_KEYS: dict[str, Key] = {
    "partition": Key(str, "#SBATCH --partition."),
    "account": Key(str, "#SBATCH --account."),
    "qos": Key(str, "#SBATCH --qos."),
    "time": Key(str, "#SBATCH --time: a time limit such as \"90\" (minutes), \"4:00:00\" or \"2-00:00:00\"."),
    "mem": Key(str, "#SBATCH --mem: host memory per node, such as \"64G\" (the seed job holds the whole model in "
                    "fp32: 4 bytes per parameter)."),
    "cpus_per_task": Key(int, "#SBATCH --cpus-per-task."),
    "exclusive": Key(bool, "#SBATCH --exclusive: whole nodes, shared with no other job."),
    "extra": Key(list, "Further #SBATCH options, each as written after #SBATCH: [\"--constraint=h100\"]."),
    "prologue": Key(list, "Shell lines run before the run, each as written: [\"module load cuda/12.4\", "
                          "\"source ~/venvs/train/bin/activate\"]."),
    "srun_options": Key(list, "Options of the srun that starts the run on each node: "
                              "[\"--container-image=/shared/torch.sqsh\", \"--container-mounts=/shared\"]."),
}
# Keys of the training jobs only (under [slurm] or [slurm.train]): the seed is one CPU process.
SLURM_TRAIN_KEYS: dict[str, Key] = {
    "device": Key(str, "What the ranks run on: \"cuda\" (one GPU per process, #SBATCH --gpus-per-node) or \"cpu\" "
                       "(one CPU per process, #SBATCH --cpus-per-task, unless cpus_per_task is set).", default="cuda"),
    "rdzv_port": Key(int, "Port of the rendezvous on the first node of a multi-node run.", default=29500),
    "save_before_limit": Key(int, "Seconds before the time limit at which SLURM asks the run to save and stop "
                                  "(#SBATCH --signal=USR1@N; the job then requeues itself and resumes). SLURM may "
                                  "signal up to 60 s earlier. 0: no signal, a run cut by its limit fails.",
                             default=120),
    "max_requeues": Key(int, "How many times a run requeues itself after saving before its time limit.",
                        default=10),
}
SLURM_KEYS: dict[str, Key] = {
    **SLURM_JOB_KEYS,
    **SLURM_TRAIN_KEYS,
    "seed": Key(dict, "Options of the seed checkpoint job only (the job keys above); it requests no GPU."),
    "train": Key(dict, "Options of the training jobs only (the control and the sets; the keys above)."),
}
SLURM_DEVICES = ("cuda", "cpu")
SLURM_LIST_KEYS = ("extra", "prologue", "srun_options")  # [slurm]'s items first, then the kind's
# #SBATCH options the protocol writes itself, and what to use instead.
SBATCH_OWNED = {
    "--job-name": "the run's name", "-J": "the run's name", "--output": "the protocol", "-o": "the protocol",
    "--nodes": "the run's degrees", "-N": "the run's degrees", "--ntasks": "the protocol", "-n": "the protocol",
    "--ntasks-per-node": "the protocol", "--gpus-per-node": "plan.gpus_per_node",
    "--dependency": "the protocol (runs wait for the seed)", "-d": "the protocol (runs wait for the seed)",
    "--signal": "the save_before_limit key", "--requeue": "the protocol (a run requeues itself after saving)",
    "--no-requeue": "the protocol (a run requeues itself after saving)", "--open-mode": "the protocol (logs append)",
    "--exclusive": "the exclusive key",
    "--partition": "the partition key", "-p": "the partition key", "--account": "the account key",
    "-A": "the account key", "--qos": "the qos key", "-q": "the qos key", "--time": "the time key",
    "-t": "the time key", "--mem": "the mem key", "--cpus-per-task": "the cpus_per_task key",
    "-c": "the cpus_per_task key",
}
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
SLURM_MEM = re.compile(r"^\d+[KMGT]?$")

TABLES = {"plan": PLAN_KEYS, "tolerance": None, "control": CONTROL_KEYS, "sets": SET_KEYS, "sweeps": SWEEP_KEYS,
          "criterion": CRITERION_KEYS, "early_stop": EARLY_STOP_KEYS, "slurm": SLURM_KEYS}
ARRAY_TABLES = ("sets", "sweeps", "early_stop")

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
    **{key: "plan.checkpoint_interval (every run saves its own checkpoints)" for key in (
        "checkpoint.enable", "checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.load_only",
        "checkpoint.last_save_model_only")},
    "parallelism.data_parallel_replicate_degree": "the set's dp_replicate",
    "parallelism.data_parallel_shard_degree": "plan.dp_degree (or a set's dp_shard with batch = 'global')",
    "parallelism.tensor_parallel_degree": "the set's tp",
    "parallelism.context_parallel_degree": "the set's cp",
    "parallelism.pipeline_parallel_degree": "the set's pp",
    "parallelism.pipeline_parallel_schedule": "the set's pp_schedule",
}
SEED_OWNED = {"checkpoint.initial_load_path": "plan.seed_checkpoint"}
# Options that decide the model or the data: one value for every run, else nothing is comparable.
# Trainer options that change the model a layout computes: only technique sets may set them.
TECHNIQUE_ONLY = {"parallelism.tensor_parallel_sync": "full", "parallelism.tensor_parallel_sync_group": 0}
SHARED_PREFIXES = ("model.",)
SHARED_KEYS = ("training.seq_len", "training.dataset", "training.dataset_path")
# model keys that change how the same weights compute, not which model: a set may change them
# (float8 linear layers are a technique, judged against the control like any other).
PER_SET_MODEL_KEYS = ("model.converters", "model.print_after_conversion")


def describe_keys() -> str:
    """Every key of every plan table with its type and meaning: the reference for the docs."""
    lines = []
    for table, schema in TABLES.items():
        title = f"[[{table}]]" if table in ARRAY_TABLES else f"[{table}]"
        if schema is None:
            lines += ["", f"{title}: the fields of protocol.plan.tolerance.Tolerance"]
            continue
        lines += ["", title]
        for key, spec in schema.items():
            need = "required" if spec.required else "optional"
            lines.append(f"  {key} ({type_word(spec.kind)}, {need}): {spec.doc}")
    return "\n".join(lines).strip()


# ---------------------------------------------------------------------------------------------
# Reading a table


def type_word(kind: type) -> str:
    return {int: "an integer", str: "a string", bool: "true or false", dict: "a table", float: "a number",
            list: "a list of strings", tuple: "an array of tables"}[kind]


def type_ok(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if kind is tuple:  # an array of tables
        return isinstance(value, list) and all(isinstance(item, dict) for item in value)
    return isinstance(value, kind)


def closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def read_table(data: Any, schema: dict[str, Key], where: str, problems: list[str]) -> dict[str, Any]:
    """Values of the keys that are known and well typed (others are reported)."""
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a table, got {short(data)}")
        return {}
    values = {}
    for key, value in data.items():
        if key not in schema:
            problems.append(f"{where}.{key}: unknown key{closest(key, list(schema))} "
                            f"(valid: {', '.join(schema)})")
        elif not type_ok(value, schema[key].kind):
            problems.append(f"{where}.{key}: expected {type_word(schema[key].kind)}, got {short(value)}")
        elif schema[key].kind is float and not math.isfinite(value):  # nan passes every bound check
            problems.append(f"{where}.{key}: expected a finite number, got {value}")
        else:
            values[key] = value
    for key, spec in schema.items():
        if spec.required and key not in data:
            problems.append(f"{where}.{key}: missing (required): {spec.doc}")
    return values


def check_choice(values: dict, key: str, choices: tuple[str, ...], where: str, problems: list[str]) -> None:
    if key in values and values[key] not in choices:
        problems.append(f"{where}.{key}: {short(values[key])} is not one of {', '.join(map(repr, choices))}"
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
