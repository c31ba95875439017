"""Fingerprints as evidence in statistical mode (protocol.verdict.fingerprint_noise): each entry's
own noise unit, the family-wise threshold holding its false-fail rate over simulated plans and
failing a deliberate fault, and a set that fails on its fingerprints alone, with its evidence named."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from protocol.verdict.compare import compare
from protocol.verdict.fingerprint_noise import DOF_EFFICIENCY, FALSE_FAIL, family_threshold, fit_noise
from protocol.verdict.fingerprints import localize
from tests.protocol.test_decision import TOL, family, run
from tests.protocol.test_fingerprint_verdict import BLOCKS, NAMES, prints

STEPS = (1, 2, 3, 4, 50, 100)


def noisy_prints(rng, sd: dict, steps=STEPS, shift: dict | None = None) -> dict:
    """A run's fingerprints: every entry's value times (1 + its own noise, growing with the step),
    and times `shift[(step, quantity, entry)]` where given."""
    shift = shift or {}
    found = {}
    for step in steps:
        line = prints(step)
        growth = 1 + step / 50
        for quantity in ("grad_norm", "update_norm", "param_norm", "output_rms", "grad_rms"):
            for entry in line[quantity]:
                noise = rng.normal(0, sd.get((quantity, entry), 1e-3)) * growth
                line[quantity][entry] *= (1 + noise) * shift.get((step, quantity, entry), 1.0)
        found[step] = line
    return found


def test_each_entry_has_its_own_noise_unit():
    """One layer's wq gradient is 20x noisier than the rest: a difference within its noise is not
    evidence there, and the same difference in a quiet layer is (pooled over the layers of the
    module, both would have had one unit between them)."""
    rng = np.random.default_rng(0)
    loud = ("grad_norm", "layers.0.attention.wq.weight")
    sd = {loud: 2e-2}
    control, noise = noisy_prints(rng, sd), [noisy_prints(rng, sd) for _ in range(4)]
    within = localize("ok", control, noisy_prints(rng, sd, shift={(2, *loud): 1.03}), noise)
    assert within.first_step is None, within.summary()
    quiet = ("grad_norm", "layers.3.attention.wq.weight")
    found = localize("bug", control, noisy_prints(rng, sd, shift={(2, *quiet): 1.03}), noise)
    assert found.first_step == 2 and found.causes[0].blocks == ("3",)
    assert fit_noise({}).unit(loud, 1) == 0.0  # no recorded step: no unit (the floor decides)


def test_the_threshold_holds_its_false_fail_rate_and_fails_a_deliberate_fault():
    """400 simulated plans of 2 correct sets (132 entries x 6 steps each, entries of 1e-4 to 1e-2
    noise): at most FALSE_FAIL of them fail on fingerprints (their tail is Student's t, the
    threshold's assumption, more tightly than Bonferroni needs); the same plans with one entry of
    one set 20 of its noise units off at one step (the threshold is t's widened 2x for
    correct layouts' heavier tails) fail in at least 95%."""
    rng = np.random.default_rng(1)
    entries = [(q, e) for q, names in (("grad_norm", NAMES), ("update_norm", NAMES), ("param_norm", NAMES),
                                       ("output_rms", BLOCKS), ("grad_rms", BLOCKS)) for e in names]
    sd = {key: 10 ** rng.uniform(-4, -2) for key in entries}
    false_fails = caught = 0
    plans = 400
    target = ("grad_norm", "layers.1.feed_forward.w1.weight")
    for _ in range(plans):
        control, noise = noisy_prints(rng, sd), [noisy_prints(rng, sd) for _ in range(4)]
        sets = [localize(f"s{i}", control, noisy_prints(rng, sd), noise, sets=2) for i in range(2)]
        false_fails += any(s.first_step is not None for s in sets)
        offset = 1 + 20 * sd[target] * math.sqrt(2) * (1 + 50 / 50)
        faulty = localize("bug", control, noisy_prints(rng, sd, shift={(50, *target): offset}), noise, sets=2)
        caught += faulty.first_step == 50 and faulty.causes[0].pattern == "layers.*.feed_forward.w1.weight"
    assert false_fails / plans <= FALSE_FAIL
    assert caught / plans >= 0.95
    k, n = 4, len(STEPS)  # noise controls, recorded steps
    dof = DOF_EFFICIENCY / (1 / (k * n) + 1 / (k * len(NAMES)))  # a parameter's norm: S steps and 39 entries
    assert sets[0].thresholds["grad_norm"] == pytest.approx(family_threshold(2 * len(entries) * n, dof))


def write_run(folder, curve, lines: dict):
    """A run folder holding the curve's metrics and its fingerprints (the norm check needs the
    logged norm to be the gradients' norm, so the curve is given theirs at the recorded steps)."""
    folder.mkdir(parents=True)
    with open(folder / "fingerprints.jsonl", "w") as f:
        for line in lines.values():
            f.write(json.dumps(line) + "\n")
    norms = dict(zip(curve.steps, curve.grad_norm))
    for step, line in lines.items():
        norms[step] = math.sqrt(sum(v * v for v in line["grad_norm"].values()))
    curve.grad_norm = [norms[s] for s in curve.steps]
    curve.source = str(folder)
    return curve


def test_a_set_whose_curves_pass_fails_on_its_fingerprints_and_says_so(tmp_path):
    rng = np.random.default_rng(2)
    curves = family(rng)
    members = [write_run(tmp_path / c.name, c, noisy_prints(rng, {})) for c in curves]
    bug = {(1, "grad_norm", "layers.2.attention.wq.weight"): 0.97}
    tests = [write_run(tmp_path / "tp2", run(rng, "tp2"), noisy_prints(rng, {})),
             write_run(tmp_path / "bug", run(rng, "bug"), noisy_prints(rng, {}, shift=bug))]
    comparison = compare(members, tests, TOL)
    good, bad = comparison.results
    assert not good.failed and good.evidence == [], good.reason
    assert bad.failed and bad.evidence == ["fingerprints"]
    assert re.match(r"fingerprints part from the control at step 1: layers\.\*\.attention\.wq\.weight gradient norm "
                    r"off by -[23]\.\d% in block 2;", bad.reason), bad.reason
    assert f"beyond {comparison.fingerprints['bug'].thresholds['grad_norm']:.2f}x its own rounding noise" in bad.reason
    assert comparison.status == "FAIL"
