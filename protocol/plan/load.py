"""Reading and validating a plan file: `load_plan(path) -> Plan`, or one `PlanError` listing every
problem with its fix.

Validation is one pass. Every table is read as far as it can be (a bad key is reported and left
out, the others are kept), and then every check runs on whatever it needs that could be read:
the name checks on every run whose name is readable, the plan's rules and the trainer's own
checks (`trainer.config.manager.load_config` and `trainer.preflight.checks.plan_run`: degrees vs world
size, heads vs TP, seq_len vs TP/CP, layers vs stages, microbatches vs schedule) on every set whose
degrees are readable. So fixing the listed problems does not reveal new ones, except those that
could not be checked at all: without a readable base config, DP degree or local batch no launch
can be built, and a set whose degrees cannot be read cannot be checked by the trainer.

Keys the plan itself sets (steps, batch, seed, degrees, output, config, checkpoint loading)
cannot be overridden: the error names the plan key to use instead. Keys that shape the model or
the data (`model.*`, `training.seq_len`, `training.dataset`, `training.dataset_path`) belong in
`[plan].overrides`, never in one run's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.plan.checks import name_problems, run_names, spec_problems, trainer_problems
from protocol.plan.criteria import Frequencies, read_criterion, read_early_stop, resolve_criterion, resolve_rules
from protocol.plan.model import Plan, RunSpec, SlurmJob, common_args, control_names, slugify
from protocol.plan.schema import (BATCH_MODES, CONTROL_KEYS, EXPECTATIONS, FINGERPRINT_ROLES, LAYOUT_KEYS,
                                  PLAN_KEYS, PLAN_OWNED,
                                  PER_SET_MODEL_KEYS, SEED_OWNED, SET_KEYS, SET_KINDS, SHARED_KEYS, SHARED_PREFIXES,
                                  TABLES, Key,
                                  check_choice, check_minimum, closest, flatten, read_table)
from protocol.plan.slurm_tables import read_slurm
from protocol.plan.sweeps import Sweep, expand_sweeps
from protocol.plan.text import short, without_control_characters
from protocol.plan.tolerance import MAX_NOISE_CONTROLS, REPLACED, Tolerance, tolerance_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

# Plan keys a launch cannot be built without; the others fall back to a stand-in for the checks.
LAUNCH_KEYS = ("config", "local_batch_size", "dp_degree")
MAX_SLUG = 100  # characters of a run's folder name (a file name has at most 255 bytes)
STAND_INS = {"name": "plan", "steps": 1}


class PlanError(ValueError):
    """A plan that cannot run as written; the message lists every problem and its fix."""


@dataclass(frozen=True)
class TableRead:
    """A control or set table as far as it could be read.

    name: None when missing or mistyped (no name check then); spec: None when the degrees or the
    batch cannot be read (no launch check then); clean: the table had no problem of its own.
    """

    where: str
    name: str | None
    spec: RunSpec | None
    clean: bool


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
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not UTF-8 text (byte {e.start}); a plan is a TOML file, which is UTF-8") from None
    except RecursionError:
        raise PlanError(f"{path}: arrays or tables nested too deeply to read; a plan nests a few levels") from None
    except ValueError:  # what Python itself refuses to read: an integer of more than 4300 digits
        raise PlanError(f"{path}: holds an integer of more digits than Python reads (4300); a plan's numbers have a "
                        "few") from None
    data, problems = without_control_characters(data)
    plan = read_plan(path, data, problems)
    if problems or plan is None:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise PlanError(f"{path}: {len(problems)} problem{'s' if len(problems) > 1 else ''}:\n{listed}")
    logger.debug("plan %s: %d launches", plan.name, len(plan.launches()))
    return plan


def read_plan(path: Path, data: dict, problems: list[str]) -> Plan | None:
    """The Plan of a parsed TOML document; every problem found is appended to `problems`.

    Returns None when no launch can be built (a key of LAUNCH_KEYS or the base config is
    unusable); the returned Plan holds only the sets whose degrees could be read, so it is the
    plan as written only when `problems` stays empty.
    """
    for table in data:
        if table not in TABLES:
            problems.append(f"[{table}]: unknown table{closest(table, list(TABLES))} (valid: {', '.join(TABLES)})")
    if "plan" not in data:
        problems.append("[plan]: missing; it names the base config, steps, local_batch_size and dp_degree")
    values = read_plan_table(data.get("plan", {}), problems) if "plan" in data else {}
    seed_checkpoint = values.get("seed_checkpoint", True)
    tolerance = read_tolerance(data.get("tolerance"), problems)
    control = read_spec(data.get("control", {}), "control", CONTROL_KEYS, seed_checkpoint, problems)
    sets, sweeps = read_sets(data.get("sets"), data.get("sweeps"), seed_checkpoint, problems)
    slurm = read_slurm(data.get("slurm", {}), problems)
    criterion = read_criterion(data.get("criterion"), problems, tolerance.mode)
    rules = read_early_stop(data.get("early_stop"), problems)
    for sweep in sweeps:
        if sweep.search and "criterion" not in data:
            problems.append(f"{sweep.where}.search: a search looks for the last point that meets the criterion; add "
                            "a [criterion] table (docs/protocol_searches.md)")

    controls = control_names(control.name or "control", tolerance)
    labels = [(read.name, f"{read.where} ({read.name!r})") for read in sets if read.name is not None]
    problems += name_problems(run_names(seed_checkpoint, controls, labels))

    plan = assemble(path, values, tolerance, control, sets, slurm, problems)
    if plan is not None:
        # "equals the control" is only decided when both tables are as intended
        problems += folded([(read.spec.label, spec_problems(plan, read.spec, read.clean and control.clean))
                            for read in (control, *sets) if read.spec is not None])
        plan = dataclasses.replace(plan, sweeps=tuple(sweeps))
        if criterion or rules:
            runs = frequencies(plan)
            plan = dataclasses.replace(plan, criterion=resolve_criterion(criterion, runs, problems),
                                       early_stop=tuple(resolve_rules(rules, runs, problems)))
    return plan


def folded(found: list[tuple[str, list[str]]]) -> list[str]:
    """The runs' problems, one line for a message that several runs share: a missing data folder
    is every run's problem, said once with the runs it stops."""
    runs_of: dict[tuple[str, bool], list[str]] = {}
    for label, problems in found:
        for problem in problems:
            message = problem.removeprefix(f"{label}: ")
            runs_of.setdefault((message, message != problem), []).append(label)
    return [f"{', '.join(labels)}: {message}" if labelled else message
            for (message, labelled), labels in runs_of.items()]


def frequencies(plan: Plan) -> Frequencies:
    """What decides which steps the runs measure, from the plan's shared options (a set's own
    overrides of validation or logging are not looked at)."""
    from trainer.config.manager import load_config

    config = load_config(common_args(plan, plan.output / "base", plan.seed))
    freq = config.validation.freq if config.validation.enable else None
    return Frequencies(steps=plan.steps, validation_freq=freq, log_freq=config.metrics.log_freq)


def assemble(path: Path, values: dict, tolerance: Tolerance, control: TableRead, sets: list[TableRead],
             slurm: dict[str, SlurmJob], problems: list[str]) -> Plan | None:
    """Build the Plan, reading what the base config decides (checkpoint folder, default schedule);
    None when a launch cannot be built (the reason is already among the problems)."""
    if any(key not in values for key in LAUNCH_KEYS):
        return None
    values = {**STAND_INS, **values}
    output = Path(values.pop("output", f"outputs/protocol/{slugify(values['name'])}")).expanduser()
    # A control whose degrees cannot be read is checked once fixed; the sets are checked now.
    stand_in = RunSpec(name=control.name or "control", kind="control", where="control")
    plan = Plan(path=path, output=output.absolute(), tolerance=tolerance, control=control.spec or stand_in,
                sets=tuple(read.spec for read in sets if read.spec is not None), slurm=slurm, **values)
    argv = common_args(plan, plan.output / "base", plan.seed)
    found = trainer_problems(argv, None, "plan")
    if found:  # every launch would fail the same way: say it once
        problems += found
        return None
    from trainer.config.manager import load_config

    config = load_config(argv)
    return dataclasses.replace(plan, checkpoint_folder=config.checkpoint.folder,
                               default_pp_schedule=config.parallelism.pipeline_parallel_schedule)


# ---------------------------------------------------------------------------------------------
# Tables


def read_plan_table(data: Any, problems: list[str]) -> dict[str, Any]:
    values = read_table(data, PLAN_KEYS, "plan", problems)
    if "name" in values and name_too_long(values["name"], "plan.name", problems):
        del values["name"]
    for key, minimum in (("steps", 1), ("warmup_steps", 0), ("local_batch_size", 1), ("dp_degree", 1),
                         ("gpus_per_node", 1), ("seed", 0), ("checkpoint_interval", 1)):
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


def read_tolerance(data: Any, problems: list[str]) -> Tolerance:
    schema = {name: Key(kind, "") for name, kind in tolerance_keys().items()}
    data = dict(data) if isinstance(data, dict) else ({} if data is None else data)
    if isinstance(data, dict):
        for key in [k for k in data if k in REPLACED]:
            problems.append(f"tolerance.{key}: no longer a key; use {REPLACED[key]} (docs/protocol_verdicts.md)")
            del data[key]
    values = read_table(data, schema, "tolerance", problems)
    values = {k: float(v) if schema[k].kind is float else v for k, v in values.items()}
    if "observables" in values:
        values["observables"] = tuple(values["observables"])
    tolerance = Tolerance(**values)
    problems += tolerance.problems()
    if not 2 <= tolerance.noise_controls <= MAX_NOISE_CONTROLS:  # reported; the launches are built with the default
        tolerance = dataclasses.replace(tolerance, noise_controls=Tolerance.noise_controls)
    return tolerance


def name_too_long(name: str, where: str, problems: list[str]) -> bool:
    """A run's name becomes a folder name (its slug), and the plan's the output folder's: one a
    file system can hold, and a reader can take in."""
    slug = slugify(name)
    if len(slug) <= MAX_SLUG:
        return False
    problems.append(f"{where}: {short(name, 60)} makes a folder name of {len(slug)} characters; give a name of at most "
                    f"{MAX_SLUG} letters and digits")
    return True


def read_degrees(values: dict, where: str, problems: list[str]) -> None:
    from trainer.parallel.stages import SCHEDULES

    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "local_batch_size"):
        check_minimum(values, key, 1, where, problems)
    check_choice(values, "pp_schedule", SCHEDULES, where, problems)
    if "pp_schedule" in values and values.get("pp", 1) == 1:
        problems.append(f"{where}.pp_schedule: has no effect without pipeline parallelism; set {where}.pp >= 2 or "
                        "remove it")


def read_spec(data: Any, where: str, schema: dict[str, Key], seed_checkpoint: bool,
              problems: list[str]) -> TableRead:
    """A control or set table: its name, and its RunSpec when its degrees and batch are readable."""
    before = len(problems)
    values = read_table(data, schema, where, problems)
    check_choice(values, "kind", SET_KINDS, where, problems)
    check_choice(values, "expect", EXPECTATIONS, where, problems)
    check_choice(values, "fingerprints", FINGERPRINT_ROLES, where, problems)
    read_degrees(values, where, problems)
    overrides = check_overrides(values.pop("overrides", {}), f"{where}.overrides", False, seed_checkpoint, problems)
    kind = values.pop("kind", None if "kind" in schema else "control")
    name = values.pop("name", None if schema["name"].required else "control")
    unusable = name is not None and name_too_long(name, f"{where}.name", problems)
    if unusable:
        name = None  # no name check, and no launch check: its folder cannot be made
    if kind == "technique" and not overrides and "overrides" not in (data if isinstance(data, dict) else {}):
        problems.append(f"{where}.overrides: a technique set needs the trainer options that turn the technique on, "
                        "e.g. { \"compile.enable\" = true }")
    readable = isinstance(data, dict) and all(key in values for key in LAYOUT_KEYS if key in data) and not unusable
    spec = None
    if readable:
        spec = RunSpec(name=name or where, kind=kind or "technique", where=where, overrides=overrides, **values)
    return TableRead(where=where, name=name, spec=spec, clean=len(problems) == before)


def read_sets(data: Any, sweeps: Any, seed_checkpoint: bool,
              problems: list[str]) -> tuple[list[TableRead], list[Sweep]]:
    """The [[sets]] tables, then the sets of the [[sweeps]] (a problem common to a sweep's points
    is listed once), and the sweeps."""
    if data is None and sweeps is None:
        problems.append("sets: the plan has no test sets; add at least one [[sets]] table with name and kind, or "
                        "a [[sweeps]] table")
        return [], []
    reads = []
    if data is not None and (not isinstance(data, list) or not all(isinstance(item, dict) for item in data)):
        problems.append("sets: expected an array of tables ([[sets]])")
    elif data is not None:
        reads = [read_spec(item, f"sets[{i}]", SET_KEYS, seed_checkpoint, problems) for i, item in enumerate(data)]
    found: list[str] = []
    points, swept = expand_sweeps(sweeps, problems)
    for point in points:
        own: list[str] = []
        read = read_spec(point.table, point.where, SET_KEYS, seed_checkpoint, own)
        if read.spec is not None:
            read = dataclasses.replace(read, spec=dataclasses.replace(read.spec, sweep=point.sweep))
        reads.append(read)
        for key, written in point.written.items():  # a swept option was written in the grid or points
            own = [p.replace(f'{point.where}.overrides."{key}"', written) for p in own]
        found += own
    problems += list(dict.fromkeys(found))
    return reads, swept


def check_overrides(raw: dict, where: str, shared: bool, seed_checkpoint: bool, problems: list[str]) -> dict:
    """Known trainer keys with values of the right type, none the plan sets itself.

    `shared` is true for [plan].overrides: only there may the model and the data be chosen.
    """
    from trainer.config.manager import ConfigError, convert, leaf_types, sections

    known = sections()
    valid = {}
    for key, value in flatten(raw).items():
        written = key if len(key) <= 100 else key[:100] + "..."  # a key may be a megabyte long
        at = f'{where}."{written}"'
        section, _, name = key.partition(".")
        if section not in known or not name:
            problems.append(f"{at}: not a trainer option; write it as \"section.key\" with section one of "
                            f"{', '.join(known)}{closest(section, list(known))}")
            continue
        types_ = leaf_types(known[section])
        if name not in types_:
            problems.append(f"{at}: unknown option {written}{closest(name, list(types_))}")
            continue
        owner = PLAN_OWNED.get(key) or (SEED_OWNED.get(key) if seed_checkpoint else None)
        if owner:
            problems.append(f"{at}: set by the plan; use {owner} instead")
            continue
        if not shared and ((key.startswith(SHARED_PREFIXES) and key not in PER_SET_MODEL_KEYS) or key in SHARED_KEYS):
            problems.append(f"{at}: decides the model or the data, which must be the same in every run; "
                            "set it in plan.overrides")
            continue
        if any(isinstance(item, float) and math.isnan(item) for item in (value if isinstance(value, list) else [value])):
            problems.append(f"{at}: nan (not a number) passes no range check of the trainer; give a number")
            continue
        try:
            convert(value, types_[name], at)
        except ConfigError as e:
            problems.append(str(e))
            continue
        valid[key] = value
    return valid
