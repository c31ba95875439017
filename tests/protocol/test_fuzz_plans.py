"""Fuzzing plan files (protocol.plan.load.load_plan): hundreds of hostile variants of the shipped
plans (tests/fuzz.py), as bytes and as TOML that parses with values of the wrong type, huge,
negative, nan, nested deep, a megabyte long, with control characters or paths out of the folder.
Each loads as a Plan whose launches can be listed, or is refused with one PlanError that names
the file and lists each problem on a line of its own; no other exception."""

from __future__ import annotations

import random
import sys

import pytest

from protocol.plan.load import PlanError, load_plan
from protocol.plan.model import REPO_ROOT
from tests.fuzz import check, dump, mutate_bytes, mutate_tree

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PLANS = REPO_ROOT / "protocol" / "plans"
# The CPU plans load in ~15 ms; the 8B plan, whose sets are checked at 8B scale, takes longer.
FAST = ["cpu_smoke.toml", "cpu_statistical.toml", "gpu_techniques.toml", "reduced_sync_cpu.toml"]
CASES = 60  # per plan and kind of mutation


def load_each(path, variants) -> dict[str, int]:
    outcomes = {"loaded": 0, "refused": 0}
    for case, data in variants:
        path.write_bytes(data)
        outcomes[check(case, lambda: load_plan(path).launches(), PlanError, path, one_line=False)] += 1
    return outcomes


@pytest.mark.parametrize("plan", FAST + ["converging_llama3_8b.toml", "reduced_sync_tp.toml"])
def test_byte_mutations_of_a_shipped_plan_load_or_are_refused(tmp_path, plan):
    rng = random.Random(0)
    data = (PLANS / plan).read_bytes()
    count = CASES if plan in FAST else CASES // 3
    outcomes = load_each(tmp_path / plan, [mutate_bytes(data, rng) for _ in range(count)])
    assert outcomes["refused"], outcomes


@pytest.mark.parametrize("plan", FAST + ["converging_llama3_8b.toml"])
def test_structural_mutations_of_a_shipped_plan_load_or_are_refused(tmp_path, plan):
    rng = random.Random(1)
    tree = tomllib.loads((PLANS / plan).read_text())
    count = 4 * CASES // 3 if plan in FAST else CASES // 2
    variants = [(case, dump(mutated, toml=True)) for case, mutated in (mutate_tree(tree, rng, toml=True)
                                                                       for _ in range(count))]
    outcomes = load_each(tmp_path / plan, variants)
    assert outcomes["loaded"] and outcomes["refused"], outcomes
