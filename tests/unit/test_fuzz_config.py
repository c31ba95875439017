"""Fuzzing the job configuration (trainer.config.manager.load_config): the shipped TOML files
(debug_model.toml is the one the entry points load by default) mutated hundreds of ways as bytes
and as TOML of wrong types, huge, negative, nan or infinite numbers, deep nesting, long strings,
control characters and paths out of the folder (tests/fuzz.py), and hostile command-line
overrides. Each loads into a valid JobConfig, or is refused with one ConfigError that names the
file or the key, each problem on a short line; no other exception."""

from __future__ import annotations

import math
import random
import sys

import pytest

from tests.fuzz import HOSTILE, check, dump, mutate_bytes, mutate_tree
from trainer.config.errors import ConfigError
from trainer.config.job_config import JobConfig
from trainer.config.manager import DEFAULT_CONFIG_FILE, TRAIN_CONFIGS_DIR, field_types, load_config, sections

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CASES = 150  # per file and kind of mutation
KEYS = [f"{section}.{key}" for section, cls in sections().items() for key in field_types(cls)]


def names_of(path) -> list[str]:
    """What a refusal may name: the file, or one of the keys ("section." begins every key)."""
    return [str(path), *(f"{section}." for section in sections())]


def loaded(config) -> None:
    assert isinstance(config, JobConfig)


def load_each(path, variants, *extra: str) -> dict[str, int]:
    outcomes = {"loaded": 0, "refused": 0}
    for case, data in variants:
        path.write_bytes(data)
        outcomes[check(case, lambda: load_config(["--job.config_file", str(path), *extra]), ConfigError,
                       names_of(path), valid=loaded, one_line=False)] += 1
    return outcomes


@pytest.mark.parametrize("name", [DEFAULT_CONFIG_FILE, "llama3_8b.toml"])
def test_byte_mutations_of_a_shipped_config_load_or_are_refused(tmp_path, name):
    rng = random.Random(0)
    data = (TRAIN_CONFIGS_DIR / name).read_bytes()
    outcomes = load_each(tmp_path / name, [mutate_bytes(data, rng) for _ in range(CASES)])
    assert outcomes["loaded"] and outcomes["refused"], outcomes


@pytest.mark.parametrize("name", [DEFAULT_CONFIG_FILE, "llama3_8b.toml"])
def test_structural_mutations_of_a_shipped_config_load_or_are_refused(tmp_path, name):
    rng = random.Random(1)
    tree = tomllib.loads((TRAIN_CONFIGS_DIR / name).read_text())
    variants = [(case, dump(mutated, toml=True)) for case, mutated in (mutate_tree(tree, rng, toml=True)
                                                                       for _ in range(2 * CASES))]
    outcomes = load_each(tmp_path / name, variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes


# The values every key is given in turn: a few of each kind of trouble.
SEVERE = ["__DEEP__", "__HUGE__", "x" * 10_000, "\ud800", "\x00", "x" * 300 + "/y", "../../etc/hostname", math.nan,
          -math.inf, 1e39, -(2**63) - 1, 2**64, [], {"a": 1}]


def test_every_key_given_each_severe_value_loads_or_is_refused(tmp_path):
    """Not left to chance: each key of every section, set in the default config to each value."""
    tree = tomllib.loads((TRAIN_CONFIGS_DIR / DEFAULT_CONFIG_FILE).read_text())
    variants = []
    for key in KEYS:
        section, _, name = key.partition(".")
        for value in SEVERE:
            mutated = {**tree, section: {**tree.get(section, {}), name: value}}
            variants.append((f"{key} = {str(value)[:40]!r}", dump(mutated, toml=True)))
    outcomes = load_each(tmp_path / "job.toml", variants)
    assert outcomes["refused"] > len(KEYS) * len(SEVERE) // 2, outcomes


def hostile_text(rng: random.Random) -> str:
    """A command-line value: what a shell could pass (no NUL), from the hostile values' text."""
    value = rng.choice(HOSTILE + ["nan", "inf", "-inf", "1e39", "-1e39", "3.5e38", "1e-46", "0x10", "1_000", " 5 ",
                                  "true", "no", "none", "a,b,,c", "=", "--x.y"])
    return str(value).replace("\x00", "") if not isinstance(value, (list, dict)) else ",".join(map(str, value))


def test_command_line_overrides_load_or_are_refused(tmp_path):
    """--section.key value for every key, with values and option spellings no one should type."""
    rng = random.Random(2)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(2 * CASES):
        key = rng.choice(KEYS)
        spelling = rng.choice(["--{key} {value}", "--{key}={value}", "--{key}", "--{section}.no_{name}",
                               "--{section}.{value}", "--{key}.x {value}", "-{key} {value}", "{value}"])
        section, _, name = key.partition(".")
        value = hostile_text(rng)
        argv = spelling.format(key=key, value="\x01", section=section, name=name).split(" ")
        argv = [value if arg == "\x01" else arg.replace("\x01", value) for arg in argv]
        case = f"argv {[a[:60] for a in argv]}"
        outcomes[check(case, lambda: load_config(argv), ConfigError, [*names_of(tmp_path), "argument "],
                       valid=loaded, one_line=False)] += 1
    assert outcomes["loaded"] and outcomes["refused"], outcomes


@pytest.mark.parametrize("name", ["x" * 300, "../../etc/hostname", "/etc/hostname", "/dev/null", "\ud800.toml",
                                  "/", "", " ", "a/" * 3000 + "b.toml"])
def test_a_config_file_name_that_is_no_config_is_refused(name):
    check(f"--job.config_file {name[:60]!r}", lambda: load_config(["--job.config_file", name]), ConfigError,
          ["job.config_file", name[:40]], valid=loaded, one_line=False)
