"""Where a set parts from the control (protocol.verdict.fingerprints), on made-up fingerprints:
the first deviating step, the modules named and ranked, what follows from what, statistical
scores against the noise controls, the run's own norm check, and the verdict and report built
on them. The same rules on real injected bugs: tests/integration/test_fingerprint_localization.py."""

from __future__ import annotations

import json
import math

import pytest

from protocol.plan.tolerance import Tolerance
from protocol.report.markdown import write_report
from protocol.verdict.compare import compare
from protocol.verdict.curves import Curve
from protocol.verdict.fingerprints import (
    EXACT_TOLERANCE,
    STATISTICAL_FLOOR,
    as_dict,
    localize,
    pattern_of,
)

BLOCKS = ("0", "1", "2", "3")
MODULES = ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "ffn_norm",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
NAMES = ["tok_embeddings.weight", *(f"layers.{b}.{m}.weight" for b in BLOCKS for m in MODULES), "norm.weight",
         "output.weight"]


def prints(step: int, scale: dict | None = None, jitter: float = 0.0) -> dict:
    """One step's fingerprints: every value 1 + index / 100 (times `scale[(quantity, entry)]`), each
    nudged by `jitter` times a fixed pattern of signs."""
    scale = scale or {}
    line = {"step": step, "skipped": False}
    for q, entries in (("grad_norm", NAMES), ("update_norm", NAMES), ("param_norm", NAMES),
                       ("output_rms", BLOCKS), ("grad_rms", BLOCKS)):
        line[q] = {e: (1 + i / 100) * scale.get((q, e), 1.0) * (1 + jitter * (-1) ** (i + step))
                   for i, e in enumerate(entries)}
    return line


def run(scale_at: dict[int, dict] | None = None, jitter: float = 0.0, steps=(1, 2, 3)) -> dict:
    return {s: prints(s, (scale_at or {}).get(s), jitter) for s in steps}


def test_a_correct_set_agrees():
    found = localize("TP2", run(), run(jitter=EXACT_TOLERANCE / 10))
    assert found.first_step is None and not found.deviates
    assert found.summary() == "fingerprints agree with the control (steps 1-3)"


def test_one_parameter_of_one_block_is_named_at_its_first_step():
    bad = {("grad_norm", "layers.2.feed_forward.w2.weight"): 1.56, ("update_norm", "layers.2.feed_forward.w2.weight"): 1.01}
    found = localize("bug", run(), run({2: bad, 3: bad}))
    assert found.first_step == 2
    top = found.causes[0]
    assert (top.quantity, top.pattern, top.blocks) == ("grad_norm", "layers.*.feed_forward.w2.weight", ("2",))
    assert len(found.causes) == 1  # its update follows from its gradient
    assert found.summary().startswith("step 2: layers.*.feed_forward.w2.weight gradient norm off by +56.0% in block 2 "
                                      "(1 more deviation follows from these)")
    assert "every block's output agrees" in found.summary()


def test_every_gradient_halved_is_one_cause():
    halved = {("grad_norm", name): 0.5 for name in NAMES}
    found = localize("bug", run(), run({1: halved}))
    assert [(g.pattern, round(g.low, 6)) for g in found.causes] == [("every parameter", -0.5)]


def test_a_norm_weight_follows_the_projections_it_feeds():
    """The gradient of attention_norm is computed from those of wq, wk, wv: when wk and wv deviate
    in the same blocks, the norm's deviation is not a cause of its own; alone, it is one."""
    both = {("grad_norm", f"layers.{b}.{m}.weight"): f for b in BLOCKS
            for m, f in (("attention.wk", 0.5), ("attention.wv", 0.45), ("attention_norm", 0.35))}
    found = localize("bug", run(), run({1: both}))
    assert [g.pattern for g in found.causes] == ["layers.*.attention.wv.weight", "layers.*.attention.wk.weight"]
    alone = {("grad_norm", f"layers.{b}.ffn_norm.weight"): 0.6 for b in BLOCKS}
    assert [g.pattern for g in localize("bug", run(), run({1: alone})).causes] == ["layers.*.ffn_norm.weight"]


def test_the_activations_say_how_far_forward_and_backward_agree():
    forward = {("output_rms", "2"): 1.01, ("output_rms", "3"): 1.02, ("grad_rms", "1"): 1.01, ("grad_rms", "0"): 1.01}
    found = localize("bug", run(), run({1: forward}))
    assert found.forward == "the forward pass agrees up to block 1 and parts at block 2"
    assert found.backward == "the backward pass agrees down to block 2 and parts below it (block 2's backward)"


def statistical_family(spread: float) -> list[dict]:
    return [run(jitter=spread * k) for k in (1, -1, 2, -2)]


def test_statistical_scores_are_in_units_of_the_noise_controls_spread():
    """With noise controls 1e-2 apart, a 1% difference is noise and a 30% one is not; where the
    noise controls agree exactly, the floor (1e-3 relative) is the unit."""
    noise = statistical_family(1e-2)
    assert localize("ok", run(), run(jitter=1e-2), noise).first_step is None
    off = {("grad_norm", f"layers.{b}.attention.wq.weight"): 1.3 for b in BLOCKS}
    found = localize("bug", run(), run({1: off}, jitter=1e-2), noise)
    assert found.first_step == 1 and found.causes[0].pattern == "layers.*.attention.wq.weight"
    quiet = statistical_family(0.0)
    assert localize("ok", run(), run(jitter=STATISTICAL_FLOOR / 2), quiet).first_step is None
    assert localize("bug", run(), run(jitter=STATISTICAL_FLOOR * 2), quiet).first_step == 1


def test_a_logged_norm_that_is_not_its_gradients_norm_is_named():
    test = run()
    total = math.sqrt(sum(v * v for v in test[1]["grad_norm"].values()))
    found = localize("bug", run(), test, logged_norms={1: total * 1.034})
    assert found.first_step is None and found.deviates
    assert found.norm_check.startswith("step 1: the logged gradient norm")
    assert localize("ok", run(), test, logged_norms={1: total}).norm_check is None


def test_skipped_entries_and_steps_are_left_out():
    test = run()
    test[1]["grad_norm"] = {name: None for name in NAMES}  # an overflowed float16 step
    del test[3]
    found = localize("fp16", run(), test)
    assert found.steps == [1, 2] and found.first_step is None


@pytest.mark.parametrize("quantity, entry, pattern, block", [
    ("grad_norm", "layers.13.attention.wq.weight", "layers.*.attention.wq.weight", "13"),
    ("param_norm", "norm.weight", "norm.weight", None),
    ("output_rms", "7", "block *", "7"),
])
def test_patterns(quantity, entry, pattern, block):
    assert pattern_of(quantity, entry) == (pattern, block)


def write_run(folder, lines: dict, losses=(3.0, 2.9, 2.8)) -> Curve:
    folder.mkdir(parents=True)
    with open(folder / "fingerprints.jsonl", "w") as f:
        for line in lines.values():
            f.write(json.dumps(line) + "\n")
    norms = [math.sqrt(sum(v * v for v in lines[s]["grad_norm"].values())) for s in (1, 2, 3)]
    return Curve(name=folder.name, steps=[1, 2, 3], loss=list(losses), grad_norm=norms, source=str(folder))


def test_exact_mode_fails_a_set_on_its_fingerprints_and_the_report_says_where(tmp_path):
    """Curves equal to the control's, one gradient off: FAIL with the module named, in report.md,
    report.json and a heat map; a set without fingerprints is judged on its curves as before."""
    control = write_run(tmp_path / "control", run())
    bad = {("grad_norm", "layers.2.feed_forward.w2.weight"): 1.56}
    buggy = write_run(tmp_path / "buggy", run({1: bad}))
    buggy.grad_norm = control.grad_norm  # the curves agree: only the fingerprints tell
    correct = write_run(tmp_path / "correct", run(jitter=1e-6))
    plain = Curve(name="plain", steps=[1, 2, 3], loss=[3.0, 2.9, 2.8], grad_norm=control.grad_norm,
                  source=str(tmp_path / "plain"))
    comparison = compare(control, [buggy, correct, plain], Tolerance(mode="exact"))
    verdicts = {r.name: (r.failed, r.reason) for r in comparison.results}
    assert verdicts["buggy"][0] and verdicts["buggy"][1].startswith(
        "fingerprints part from the control at step 1: layers.*.feed_forward.w2.weight gradient norm off by +56.0%")
    assert not verdicts["correct"][0] and not verdicts["plain"][0]
    assert comparison.status == "FAIL" and set(comparison.fingerprints) == {"buggy", "correct"}
    paths = write_report(comparison, control, [buggy, correct, plain], tmp_path / "report")
    text = paths["markdown"].read_text()
    assert "## Where the sets part from the control (fingerprints)" in text
    assert "- **buggy**: step 1: layers.*.feed_forward.w2.weight gradient norm off by +56.0% in block 2" in text
    assert "- **correct**: fingerprints agree with the control (steps 1-3)" in text
    assert paths["fingerprints buggy"].name == "fingerprints-buggy.png" and paths["fingerprints buggy"].stat().st_size
    record = json.loads(paths["json"].read_text())["fingerprints"]["buggy"]
    assert record["first_step"] == 1 and record["causes"][0]["module"] == "layers.*.feed_forward.w2.weight"
    assert record == json.loads(json.dumps(as_dict(comparison.fingerprints["buggy"])))


def test_a_set_whose_fingerprints_only_localize_is_judged_by_its_curves(tmp_path):
    """fingerprints = "localize" (a technique that changes the numbers on purpose, as float8 does):
    the same deviating fingerprints that fail a set name where it parts, and the curves judge it."""
    control = write_run(tmp_path / "control", run())
    technique = write_run(tmp_path / "float8", run({1: {("grad_norm", "layers.2.feed_forward.w2.weight"): 1.01}}))
    technique.grad_norm = control.grad_norm  # its curves agree with the control's
    judged = {localize_only: compare(control, [technique], Tolerance(mode="exact"), localize_only=localize_only)
              for localize_only in (frozenset(), frozenset({"float8"}))}
    assert judged[frozenset()].results[0].evidence == ["fingerprints"]
    comparison = judged[frozenset({"float8"})]
    assert not comparison.results[0].failed and comparison.status == "PASS"
    assert comparison.fingerprints["float8"].first_step == 1  # still said where
    text = write_report(comparison, control, [technique], tmp_path / "report")["markdown"].read_text()
    assert ('- **float8** (fingerprints = "localize": a technique that changes the numbers on purpose, judged by its '
            "curves; this says where, and fails nothing): step 1: layers.*.feed_forward.w2.weight gradient norm off "
            "by +1.00% in block 2") in text


def with_branches(line: dict) -> dict:
    """A line as the trainer writes it now: the blocks' attention and feed-forward branches too."""
    return {**line, "attention_rms": {b: 0.5 + int(b) / 10 for b in BLOCKS}, "ffn_rms": {b: 0.7 + int(b) / 10 for b in BLOCKS}}


def test_a_forward_deviation_is_named_within_its_block():
    """With the branches recorded, the first deviating block's attention or feed-forward branch is
    named: a bug in block 2's feed-forward moves its ffn_rms and output, not its attention."""
    control = {s: with_branches(prints(s)) for s in (1, 2)}
    test = {s: with_branches(prints(s)) for s in (1, 2)}
    for step in (1, 2):
        test[step]["ffn_rms"]["2"] *= 1.02
        test[step]["output_rms"]["2"] *= 1.001
        test[step]["output_rms"]["3"] *= 1.001
    found = localize("bug", control, test)
    assert found.forward == ("the forward pass agrees up to block 1 and parts at block 2, in its feed-forward branch "
                             "(its attention branch agrees)")
    assert [g.quantity for g in found.groups if g.pattern == "block *"][:1] == ["ffn_rms"]
    test[1]["attention_rms"]["0"] *= 1.01
    assert localize("bug", control, test).forward == "the forward pass parts at block 0, in its attention branch"
    assert pattern_of("attention_rms", "5") == ("block *", "5")
