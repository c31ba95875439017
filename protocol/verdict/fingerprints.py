"""Where a test set parts from the control: the per-module fingerprints of its runs
(metrics.fingerprints, trainer/metrics/fingerprints.py) compared with the control's, entry by entry and
step by step, from step 1.

Each entry (a parameter's gradient, update or weight norm; a block's output or gradient RMS) at a
step has a *score*: its relative difference from the control in units of what would be evidence.
  exact mode        EXACT_TOLERANCE, 1e-4 relative: correct float32 layouts (the parity matrix,
                    every parallelism and pipeline schedule) differ by 3.3e-6 at most.
  statistical mode  the entry's own rounding noise at that step, measured by the control family
                    (protocol.verdict.fingerprint_noise: per entry, not pooled over the blocks;
                    the difference is taken from the family's mean),
                    times a family-wise threshold over every entry of every recorded step of every
                    set of the plan, so that a plan of correct sets fails on its fingerprints with
                    probability at most 1%; and never below 1e-3 relative. A set whose
                    fingerprints deviate fails (compare.py).
An entry deviates when its score exceeds 1. The first step with a deviating entry is where the set
parts from the control. At that step the deviating entries are grouped by module (the layer index
replaced by `*`) and ranked by their largest score; the block activations say how far the forward
pass (output RMS, from the first block on) and the backward pass (gradient RMS, from the last block
down) still agree.

A run also checks itself: the norm of its parameters' gradient norms must be the global gradient
norm it logged (metrics.jsonl); when they differ the norm's reduction is wrong, whatever the
fingerprints of the set say.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from protocol.verdict.fingerprint_noise import FLOOR as STATISTICAL_FLOOR
from protocol.verdict.fingerprint_noise import NoiseModel, family_threshold, fit_noise, score
from trainer.records.run_meta import BLOCK_QUANTITIES, BRANCH_QUANTITIES, FINGERPRINTS_FILE, PARAMETER_QUANTITIES

ACTIVATIONS = BLOCK_QUANTITIES + BRANCH_QUANTITIES  # per block
QUANTITIES = PARAMETER_QUANTITIES + ACTIVATIONS
LABELS = {"grad_norm": "gradient norm", "update_norm": "update norm", "param_norm": "weight norm",
          "output_rms": "output RMS", "grad_rms": "gradient RMS", "attention_rms": "attention output RMS",
          "ffn_rms": "feed-forward output RMS"}
EXACT_TOLERANCE = 1e-4
NORM_CHECK_TOLERANCE = 1e-6  # float64 sums in two orders agree far better
LAYER = re.compile(r"^layers\.(\d+)\.")

Prints = dict[int, dict]  # step -> one line of fingerprints.jsonl


def read_fingerprints(folder: Path) -> Prints | None:
    """step -> the recorded line, or None when the run recorded no fingerprints."""
    path = Path(folder) / FINGERPRINTS_FILE
    if not path.is_file():
        return None
    prints = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash
        if isinstance(record, dict) and type(record.get("step")) is int:  # else not a line the trainer wrote
            prints[record["step"]] = record
    return prints


def pattern_of(quantity: str, entry: str) -> tuple[str, str | None]:
    """(module pattern, block): 'layers.3.attention.wq.weight' -> ('layers.*.attention.wq.weight',
    '3'); a block activation '3' -> ('block *', '3'); 'norm.weight' -> ('norm.weight', None)."""
    if quantity in ACTIVATIONS:
        return "block *", entry
    match = LAYER.match(entry)
    if match is None:
        return entry, None
    return LAYER.sub("layers.*.", entry, count=1), match.group(1)


@dataclass(frozen=True)
class Group:
    """The deviating entries of one module pattern and quantity at one step."""

    quantity: str
    pattern: str
    blocks: tuple[str, ...]  # the deviating blocks ('' for a module outside the blocks)
    of: int  # entries of this pattern in the model
    low: float  # the smallest and largest relative difference (signed)
    high: float
    score: float  # the largest score

    def phrase(self) -> str:
        if math.isclose(self.low, self.high, rel_tol=0.05):
            spread = share(self.low)
        else:  # both ends in one format, chosen by the larger
            scale = max(abs(self.low), abs(self.high))
            spread = f"{share(self.low, scale)} to {share(self.high, scale)}"
        where = ""
        if self.blocks and self.blocks != ("",):
            where = f" in every block" if len(self.blocks) == self.of else \
                f" in block{'s' if len(self.blocks) > 1 else ''} {', '.join(self.blocks)}"
        return f"{self.pattern} {LABELS[self.quantity]} off by {spread}{where}"


def share(value: float, scale: float | None = None) -> str:
    """A relative difference as a percentage (two decimals below 1%), or in powers of ten when it
    is below 0.1%; `scale`: the magnitude that chooses the format (a range's larger end)."""
    scale = abs(value) if scale is None else scale
    if scale >= 1e-2:
        return f"{value:+.1%}"
    return f"{value:+.2%}" if scale >= 1e-3 else f"{value * 100:+.1e}%"


@dataclass
class Localization:
    """Where one test set parts from the control."""

    name: str
    mode: str  # "exact" | "statistical"
    steps: list[int]  # the steps compared
    first_step: int | None = None  # the first with a deviating entry (None: none deviates)
    groups: list[Group] = field(default_factory=list)  # at first_step, the most deviating first
    forward: str = ""  # how far the forward / backward activations agree at first_step
    backward: str = ""
    scores: dict[tuple[str, str], float] = field(default_factory=dict)  # (quantity, entry) -> score at first_step
    relative: dict[tuple[str, str], float] = field(default_factory=dict)
    norm_check: str | None = None  # the set's logged global norm is not its gradients' norm
    peak: float = 0.0  # the largest score over every compared step (calibration reads it)
    peak_at: tuple[int, str, str] | None = None  # (step, quantity, entry) of the peak
    thresholds: dict[str, float] = field(default_factory=dict)  # statistical: per quantity, in noise units

    @property
    def deviates(self) -> bool:
        return self.first_step is not None or self.norm_check is not None

    @property
    def causes(self) -> list[Group]:
        """The groups whose deviation does not follow from another's (see `follows`)."""
        return [g for g in self.groups if not follows(g, self.groups)]

    def summary(self, top: int = 3) -> str:
        if self.first_step is None:
            checked = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no step"
            return f"fingerprints agree with the control ({checked})" + (f"; {self.norm_check}" if self.norm_check else "")
        causes = self.causes
        named = "; ".join(g.phrase() for g in causes[:top])
        hidden = len(causes) - top
        more = f"; {hidden} smaller cause{'s' if hidden > 1 else ''} (report.json)" if hidden > 0 else ""
        following = len(self.groups) - len(causes)
        follow = (f" ({following} more deviations follow from these)" if following > 1 else " (1 more deviation follows from these)") if following else ""
        return f"step {self.first_step}: {named}{more}{follow}; {self.forward}; {self.backward}"


def relative_differences(control: dict, test: dict) -> dict[tuple[str, str], float]:
    """(quantity, entry) -> (test - control) / |control| where both are recorded and finite."""
    found = {}
    for quantity in QUANTITIES:
        theirs = test.get(quantity, {})
        for entry, value in control.get(quantity, {}).items():
            other = theirs.get(entry)
            if value is None or other is None:
                continue  # a skipped float16 step, or a block inside a reduced-sync group
            if value == 0:
                found[(quantity, entry)] = 0.0 if other == 0 else math.copysign(1e9, other)
            else:
                found[(quantity, entry)] = (other - value) / abs(value)
    return found


def localize(name: str, control: Prints, test: Prints, noise: list[Prints] = (),
             logged_norms: dict[int, float] | None = None, sets: int = 1) -> Localization:
    """Compare a test set's fingerprints with the control's (exact mode) or with the control
    family's mean (statistical mode, when noise controls' fingerprints are given) from the first
    step on. `sets`: the plan's test sets with fingerprints, over which the statistical threshold
    is family-wise."""
    common = set(control) & set(test)
    for member in noise:
        common &= set(member)
    found = Localization(name, "statistical" if noise else "exact", sorted(common))
    found.norm_check = check_norm(test, logged_norms or {})
    reference, model = (control, None) if not noise else family_fit([control, *noise], found.steps)
    relative = {step: relative_differences(reference[step], test[step]) for step in found.steps}
    scorer = exact_scores if not noise else statistical_scorer(model, found, relative, sets)
    for step in found.steps:
        scores = scorer(step, relative[step])
        peak = max(scores.items(), key=lambda item: item[1], default=None)
        if peak and peak[1] > found.peak:
            found.peak, found.peak_at = peak[1], (step, *peak[0])
        if found.first_step is None and peak and peak[1] > 1:
            found.first_step, found.scores, found.relative = step, scores, relative[step]
            found.groups = group_deviations(relative[step], scores, reference[step])
            found.forward, found.backward = activation_story(scores, reference[step])
    return found


def family_mean(lines: list[dict]) -> dict:
    """One step's fingerprints averaged over the family, entry by entry (an entry any member
    left unrecorded is left out)."""
    mean = {}
    for quantity in QUANTITIES:
        values: dict[str, list] = {}
        for line in lines:
            for entry, value in line.get(quantity, {}).items():
                values.setdefault(entry, []).append(value)
        mean[quantity] = {entry: sum(v) / len(v) for entry, v in values.items()
                          if len(v) == len(lines) and None not in v}
    return mean


def exact_scores(step: int, relative: dict) -> dict:
    return {key: abs(value) / EXACT_TOLERANCE for key, value in relative.items()}


def family_fit(family: list[Prints], steps: list[int]) -> tuple[Prints, NoiseModel]:
    """(the family's mean fingerprints at each step, its noise units): what statistical mode
    compares a set with, and in what units (protocol.verdict.fingerprint_noise)."""
    reference = {step: family_mean([member[step] for member in family]) for step in steps}
    model = fit_noise({step: [relative_differences(reference[step], member[step]) for member in family]
                       for step in steps})
    return reference, model


def statistical_scorer(model: NoiseModel, found: Localization, relative: dict, sets: int):
    """Statistical mode's scores: each entry's difference in its noise units, over the family-wise
    threshold for every entry of every step of the plan's `sets` sets (kept on `found`)."""
    comparisons = sets * sum(len(values) for values in relative.values())
    found.thresholds = {quantity: family_threshold(comparisons, model.dof(quantity)) for quantity in model.entries}

    def scores(step: int, differences: dict) -> dict:
        return {key: score(value, model.unit(key, step), found.thresholds.get(key[0], math.inf))
                for key, value in differences.items()}
    return scores


# What each norm weight feeds: its gradient is computed from theirs (backward), so when theirs
# deviates too, the norm's deviation follows from it.
FEEDS = {"attention_norm": ("attention.wq", "attention.wk", "attention.wv"),
         "ffn_norm": ("feed_forward.w1", "feed_forward.w3"), "norm": ("output",)}


def group_deviations(relative: dict, scores: dict, control: dict) -> list[Group]:
    """The deviating entries by (quantity, module pattern): first the causes, the highest score
    first, then what follows from them (see `follows`); a quantity off by about the same share
    for every parameter is one group ('every parameter')."""
    members: dict[tuple[str, str], list[str]] = {}
    for quantity in QUANTITIES:
        for entry in control.get(quantity, {}):
            members.setdefault((quantity, pattern_of(quantity, entry)[0]), []).append(entry)
    groups = []
    for (quantity, pattern), entries in members.items():
        bad = [e for e in entries if scores.get((quantity, e), 0.0) > 1]
        if not bad:
            continue
        values = [relative[(quantity, e)] for e in bad]
        groups.append(Group(quantity, pattern, tuple(pattern_of(quantity, e)[1] or "" for e in bad), len(entries),
                            min(values), max(values), max(scores[(quantity, e)] for e in bad)))
    groups = merge_uniform(groups, members)
    return sorted(groups, key=lambda g: (follows(g, groups), -g.score))


def module_of(pattern: str) -> str:
    """'layers.*.attention.wq.weight' -> 'attention.wq'; 'norm.weight' -> 'norm'."""
    return pattern.removeprefix("layers.*.").rpartition(".")[0]


def follows(group: Group, groups: list[Group]) -> bool:
    """Whether a group's deviation follows from another's: a parameter's update or weight from
    its own gradient (or its update), a norm weight's gradient from the gradient of a projection
    it feeds, in the same blocks; activations are told apart by `activation_story`."""
    if group.quantity in ACTIVATIONS:
        return True
    deviating = {(g.quantity, g.pattern): g for g in groups}
    if group.pattern == "every parameter":
        return group.quantity != "grad_norm" and ("grad_norm", "every parameter") in deviating
    earlier = PARAMETER_QUANTITIES[:PARAMETER_QUANTITIES.index(group.quantity)]
    if any((q, group.pattern) in deviating or (q, "every parameter") in deviating for q in earlier):
        return True
    fed = FEEDS.get(module_of(group.pattern), ())
    prefix = "layers.*." if group.pattern.startswith("layers.*.") else ""
    return any(set(group.blocks) & set(deviating[(group.quantity, f"{prefix}{f}.weight")].blocks)
               for f in fed if (group.quantity, f"{prefix}{f}.weight") in deviating)


def merge_uniform(groups: list[Group], members: dict) -> list[Group]:
    """A parameter quantity that deviates in every entry by one share (within 5%: e.g. every
    gradient halved) becomes one group: the cause is not in any one module."""
    merged = []
    for quantity in PARAMETER_QUANTITIES:
        mine = [g for g in groups if g.quantity == quantity]
        patterns = [p for q, p in members if q == quantity]
        if len(mine) < 2 or len(mine) != len(patterns) or any(len(g.blocks) != g.of for g in mine):
            continue
        low, high = min(g.low for g in mine), max(g.high for g in mine)
        if math.isclose(low, high, rel_tol=0.05):
            merged.append(Group(quantity, "every parameter", (), sum(g.of for g in mine), low, high,
                                max(g.score for g in mine)))
            groups = [g for g in groups if g.quantity != quantity]
    return groups + merged


def activation_story(scores: dict, control: dict) -> tuple[str, str]:
    """How far the forward pass (block outputs, first block on; within a block, its attention
    branch, then its feed-forward branch, where recorded) and the backward pass (the gradient
    reaching each block's output, last block down) agree with the control."""
    blocks = sorted(control.get("output_rms", {}), key=int)
    off = lambda quantity, block: scores.get((quantity, block), 0.0) > 1  # noqa: E731
    forward = [b for b in blocks if off("output_rms", b) or any(off(q, b) for q in BRANCH_QUANTITIES)]
    backward = [b for b in reversed(blocks) if off("grad_rms", b)]
    if not blocks:
        return "no block activations recorded", ""
    if not forward:
        says_forward = "every block's output agrees"
    else:
        part, inside = forward[0], inside_block(forward[0], off, control)
        if part != blocks[0]:
            says_forward = f"the forward pass agrees up to block {blocks[blocks.index(part) - 1]} and parts at block {part}"
        else:
            says_forward = f"the forward pass parts at block {part}" + ("" if inside else "'s output")
        says_forward += inside
    if not backward:
        says_backward = "so does the gradient reaching each block" if not forward else \
            "the gradient reaching each block agrees"
    elif backward[0] == blocks[-1]:
        says_backward = "the gradient reaching the last block already differs (the output layer or the loss)"
    else:
        above = blocks[blocks.index(backward[0]) + 1]
        says_backward = f"the backward pass agrees down to block {above} and parts below it (block {above}'s backward)"
    return says_forward, says_backward


def inside_block(block: str, off, control: dict) -> str:
    """Which branch of the block a forward deviation starts in, where the branches were recorded."""
    if not all(block in control.get(q, {}) for q in BRANCH_QUANTITIES):
        return ""  # older files, or a block inside a reduced-sync TP group
    if off("attention_rms", block):
        return ", in its attention branch"
    if off("ffn_rms", block):
        return ", in its feed-forward branch (its attention branch agrees)"
    return ", though both its branches agree (the residual sum)"


def check_norm(test: Prints, logged_norms: dict[int, float]) -> str | None:
    """The run's own consistency: at each recorded step, its logged global gradient norm must be
    the norm of its parameters' gradient norms."""
    for step, line in sorted(test.items()):
        logged = logged_norms.get(step)
        norms = list(line.get("grad_norm", {}).values())
        if logged is None or not norms or any(v is None for v in norms) or not math.isfinite(logged):
            continue
        total = math.sqrt(sum(v * v for v in norms))
        if abs(total - logged) > NORM_CHECK_TOLERANCE * max(abs(logged), 1e-30):
            return (f"step {step}: the logged gradient norm {logged:.6g} is not the norm of the parameters' "
                    f"gradients, {total:.6g} ({logged / total:.3f}x): the global norm's reduction counts some "
                    "gradients wrongly (the gradients themselves are what the fingerprints compare)")
    return None


def run_folder(curve) -> Path:
    """The folder a curve was read from (its metrics.jsonl's folder)."""
    source = Path(curve.source)
    return source if source.is_dir() else source.parent


def localize_sets(family: list, tests: list, mode: str) -> dict[str, Localization]:
    """Set name -> where it parts from the control, for every set whose runs recorded fingerprints
    (and, in statistical mode, whose noise controls did too); empty when the control has none."""
    control = read_fingerprints(run_folder(family[0]))
    if not control:
        return {}
    noise: list[Prints] = []
    if mode == "statistical":
        noise = [read_fingerprints(run_folder(curve)) or {} for curve in family[1:]]
        if not all(noise):
            return {}
    recorded = {test.name: prints for test in tests if (prints := read_fingerprints(run_folder(test)))}
    found = {}
    for test in tests:
        if test.name in recorded:
            logged = dict(zip(test.steps, test.grad_norm)) if test.grad_norm is not None else {}
            found[test.name] = localize(test.name, control, recorded[test.name], noise, logged, sets=len(recorded))
    return found


def as_dict(found: Localization) -> dict:
    """report.json's record of a set's localization."""
    return {"mode": found.mode, "steps": found.steps, "first_step": found.first_step, "summary": found.summary(),
            "causes": [group_dict(g) for g in found.causes],
            "groups": [group_dict(g) for g in found.groups], "forward": found.forward, "backward": found.backward,
            "norm_check": found.norm_check, "peak": found.peak, "peak_at": list(found.peak_at or []) or None,
            "thresholds": found.thresholds}


def group_dict(group: Group) -> dict:
    return {"quantity": group.quantity, "module": group.pattern, "blocks": list(group.blocks), "of": group.of,
            "low": group.low, "high": group.high, "score": group.score}
