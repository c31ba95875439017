"""A plan's [slurm] tables: the options of the sbatch scripts of its jobs (protocol.run.sbatch),
checked as they are read. What goes onto an #SBATCH line is read by sbatch itself, not bash, so a
value that sbatch would split or cut is refused here (protocol.plan.text)."""

from __future__ import annotations

from typing import Any

from protocol.plan.model import SlurmJob
from protocol.plan.schema import (SBATCH_OWNED, SLURM_DEVICES, SLURM_JOB_KEYS, SLURM_KEYS, SLURM_KINDS,
                                  SLURM_LIST_KEYS, SLURM_MEM, SLURM_TIME, SLURM_TRAIN_KEYS, check_choice,
                                  check_minimum, read_table)
from protocol.plan.text import SBATCH_RULE, sbatch_special, short

def read_slurm(data: Any, problems: list[str]) -> dict[str, SlurmJob]:
    """[slurm] options apply to every job; [slurm.seed] and [slurm.train] to one kind, over them
    (their list options, extra, prologue and srun_options, come after the common ones). The keys
    of training jobs only (SLURM_TRAIN_KEYS) are refused in [slurm.seed], and the seed job does not
    take them from [slurm]."""
    every_key = {**SLURM_JOB_KEYS, **SLURM_TRAIN_KEYS}
    values = read_table(data, SLURM_KEYS, "slurm", problems)
    common = read_slurm_job(values, "slurm", problems)
    jobs = {}
    for kind in SLURM_KINDS:
        table, inherited = values.get(kind, {}), common
        if kind == "seed":
            for key in SLURM_TRAIN_KEYS.keys() & table.keys():
                problems.append(f"slurm.seed.{key}: only training jobs have it (the seed is one process on the CPU); "
                                "set it under [slurm] or [slurm.train]")
            table = {key: value for key, value in table.items() if key not in SLURM_TRAIN_KEYS}
            inherited = {key: value for key, value in common.items() if key not in SLURM_TRAIN_KEYS}
        own = read_slurm_job(read_table(table, every_key, f"slurm.{kind}", problems), f"slurm.{kind}", problems)
        lists = {key: (*inherited.get(key, ()), *own.get(key, ())) for key in SLURM_LIST_KEYS}
        jobs[kind] = SlurmJob(**{**inherited, **own, **lists})
    return jobs


def read_slurm_job(values: dict, where: str, problems: list[str]) -> dict[str, Any]:
    """The job keys of one table, checked; returns the valid ones."""
    job = {key: value for key, value in values.items() if key in SLURM_JOB_KEYS or key in SLURM_TRAIN_KEYS}
    check_minimum(job, "cpus_per_task", 1, where, problems)
    check_choice(job, "device", SLURM_DEVICES, where, problems)
    check_minimum(job, "save_before_limit", 0, where, problems)
    check_minimum(job, "max_requeues", 0, where, problems)
    if "rdzv_port" in job and not 1 <= job["rdzv_port"] <= 65535:
        problems.append(f"{where}.rdzv_port: {job['rdzv_port']} is not a port (1-65535)")
        del job["rdzv_port"]
    for key in ("prologue", "srun_options"):
        bad = [item for item in job.get(key, ()) if not isinstance(item, str)]
        if bad:
            problems.append(f"{where}.{key}: expected a list of strings, got {bad[0]!r}")
            del job[key]
        elif key in job:
            job[key] = tuple(job[key])
    for key in ("partition", "account", "qos"):  # names, written as they are on an #SBATCH line
        special = sbatch_special(job[key]) if key in job else None
        if special:
            problems.append(f"{where}.{key}: {short(job[key])} would not reach SLURM whole (it holds {special}): "
                            f"{SBATCH_RULE}; give the {key} as SLURM names it")
            del job[key]
    for key, pattern, example in (("time", SLURM_TIME, '"90" (minutes), "4:00:00" or "2-00:00:00"'),
                                  ("mem", SLURM_MEM, '"64G" or "500M"')):
        if key in job and not pattern.fullmatch(job[key]):
            problems.append(f"{where}.{key}: {job[key]!r} is not a SLURM {key}; write it like {example}")
            del job[key]
    continued = [i for i, line in enumerate(job.get("prologue", ())) if line.endswith("\\")]
    for i in continued:  # bash would read the script's next line as part of it
        problems.append(f"{where}.prologue[{i}]: {short(job['prologue'][i])} ends with a backslash, which would join "
                        "the script's next line to it; give each command whole on one line")
    if continued:
        del job["prologue"]
    extra = []
    for option in job.pop("extra", []):
        problem = extra_problem(option)
        if problem:
            problems.append(f"{where}.extra: {problem}")
        else:
            extra.append(option)
    if extra:
        job["extra"] = tuple(extra)
    return job


def extra_problem(option: str) -> str | None:
    """Why an `extra` item cannot be an #SBATCH line, or None: it is one option (--name=value, or
    an option and its value), none that the protocol writes itself, with nothing sbatch would read
    otherwise than as written."""
    words = option.split()
    if not words or not words[0].startswith("-"):
        return f"{option!r} is not an sbatch option; write it as after #SBATCH, e.g. \"--constraint=h100\""
    owned = [flag for flag in (word.split("=", 1)[0] for word in words) if flag in SBATCH_OWNED]
    if owned:
        return f"{option!r} is set by {SBATCH_OWNED[owned[0]]}; remove it"
    one_option = len(words) == 1 or (len(words) == 2 and "=" not in words[0] and not words[1].startswith("-"))
    special = sbatch_special("".join(words) if one_option else option)
    if special:
        return (f"{short(option)} would not reach SLURM whole (it holds {special}): {SBATCH_RULE}; give one option "
                "per item, as --name=value")
    return None
