"""The statistical verdict's measured power: correct layouts must pass, injected bugs must fail.

    python benchmarks/protocol_power.py [--repeats 5] [--steps 300] [--noise-controls 4]
                                        [--cases NAME,...] [--out DIR] [--json FILE] [--quick]

Each repeat is one whole experiment with its own seed (its own data and seed checkpoint): the
control, its noise controls, and one test set per case, all in bfloat16 (--dtype) on the tiny
Llama on the synthetic_context source (--dataset; python_stdlib: real text), run by the
protocol's own local runner and judged by the protocol's own comparison (the shipped statistical
rule: curves, fingerprints and a set's own noise), each case as the one set of a plan of its own.
Cases:

  correct layouts      TP 2, PP 2 (Interleaved1F1B), CP 2, FSDP 2 x TP 2 x PP 2
  configuration faults optimizer.lr 5% and 2% high, optimizer.weight_decay 2% high
  parallelism bugs     injected by benchmarks/faults (the shipped trainer cannot enable them):
                       TP norm-weight gradients not all-reduced, CP key/value gradients not
                       reduce-scattered, the global grad norm counting TP replicas once per rank,
                       CP RoPE applied at chunk-local positions, CP RoPE of the tail chunk at
                       another chunk's positions, half of the TP key heads rotated half a
                       sequence off, one TP rank doubling one block's w2 gradient, FSDP averaging
                       its gradient reduce-scatter (needs DP > 1)

It prints, per case, the verdicts over the repeats, which evidence failed the runs (curves,
fingerprints, own noise) and the mean final-window difference of each
observable in units of the noise (the spread a correct set has); then the false-fail rate (correct
layouts that failed), the false-pass rate (faults that passed), the minimum detectable effect;
how the noise controls' paired difference grows with steps; and the same rates re-judged under
other settings (fewer noise controls, other margins, another window) from the same runs, which is
how the shipped defaults were chosen. --quick is the small version the test suite runs (1 repeat,
100 steps, DP 1, 3 noise controls, one correct layout and one bug).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common import REPO, machine, table  # noqa: I001 (sets sys.path)

from protocol.plan.load import load_plan
from protocol.plan.tolerance import Tolerance
from protocol.run.local import run_local
from protocol.verdict.compare import compare
from protocol.verdict.curves import read_curve
from protocol.verdict.fingerprints import as_dict
from protocol.verdict.gather import gather

FAULT_LAUNCHER = [sys.executable, str(REPO / "benchmarks" / "faults" / "launch.py")]


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # "correct", "config fault" or "bug"
    table: str  # the [[sets]] body, TOML
    fault: str | None = None  # benchmarks/faults/faults_catalog.py

    @property
    def must_fail(self) -> bool:
        return self.group != "correct"


INTERLEAVED = 'pp = 2\npp_schedule = "Interleaved1F1B"'
CASES = [
    Case("TP2", "correct", 'kind = "parallelism"\ntp = 2'),
    Case("PP2 Interleaved1F1B", "correct", f'kind = "parallelism"\n{INTERLEAVED}'),
    Case("CP2", "correct", 'kind = "parallelism"\ncp = 2'),
    Case("3D TP2 PP2", "correct", f'kind = "parallelism"\ntp = 2\n{INTERLEAVED}'),
    Case("lr x1.05", "config fault", 'kind = "technique"\noverrides = {{ "optimizer.lr" = {lr_105} }}'),
    Case("weight decay x1.02", "config fault", 'kind = "technique"\noverrides = {{ "optimizer.weight_decay" = {wd_102} }}'),
    Case("TP2 norm grad not reduced", "bug", 'kind = "parallelism"\ntp = 2', "tp_norm_grad_unreduced"),
    Case("CP2 K/V grad not reduced", "bug", 'kind = "parallelism"\ncp = 2', "cp_kv_grad_unreduced"),
    Case("TP2 norm counts replicas", "bug", 'kind = "parallelism"\ntp = 2', "norm_counts_replicas"),
    Case("CP2 RoPE unshifted", "bug", 'kind = "parallelism"\ncp = 2', "cp_rope_unshifted"),
    Case("CP2 RoPE tail chunk misplaced", "bug", 'kind = "parallelism"\ncp = 2', "cp_rope_tail_misplaced"),
    Case("TP2 RoPE half the keys shifted", "bug", 'kind = "parallelism"\ntp = 2', "tp_rope_half_keys"),
    Case("TP2 w2 grad doubled in block 2", "bug", 'kind = "parallelism"\ntp = 2', "tp_w2_grad_doubled_in_one_block"),
    Case("FSDP grads averaged (under TP2)", "bug", 'kind = "parallelism"\ntp = 2', "fsdp_grad_averaged"),
    Case("lr x1.02", "config fault", 'kind = "technique"\noverrides = {{ "optimizer.lr" = {lr_102} }}'),
]
QUICK_CASES = ("TP2", "TP2 norm grad not reduced", "CP2 RoPE unshifted")
FULL = {"repeats": 5, "first_seed": 0, "steps": 300, "noise_controls": Tolerance().noise_controls, "dp": 2,
        "local_batch": 4}
# Seed 0 on synthetic_context: TP2 sits at +2.3 and +0.0 noise SDs (loss, grad norm) of a 4.5 bound
# (the plan-level rule for a plan of one set, 3 noise controls); the TP norm bug at -23 in the norm,
# the CP RoPE bug at +9.5 and -6.4 (docs/protocol_measurements.md).
QUICK = {"repeats": 1, "first_seed": 0, "steps": 100, "noise_controls": 3, "dp": 1, "local_batch": 8,
         "cases": ",".join(QUICK_CASES)}
LR, WEIGHT_DECAY = 3e-3, 0.1

PLAN = """
[plan]
name = "power-{seed}"
config = "debug_model.toml"
output = "{output}"
steps = {steps}
warmup_steps = {warmup}
local_batch_size = {local_batch}
dp_degree = {dp}
seed = {seed}
gpus_per_node = 8

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 64
"training.dataset" = "{dataset}"
"training.mixed_precision_param" = "{dtype}"
"optimizer.lr" = {lr}
"optimizer.weight_decay" = {wd}
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"debug.deterministic" = true
"metrics.fingerprint_every" = {fingerprint_every}

[tolerance]
mode = "statistical"
noise_controls = {noise_controls}
"""


def plan_text(cases: list[Case], seed: int, output: Path, args) -> str:
    text = PLAN.format(seed=seed, output=output, steps=args.steps, warmup=max(1, args.steps // 15),
                       local_batch=args.local_batch, dp=args.dp, lr=LR, wd=WEIGHT_DECAY, dataset=args.dataset,
                       noise_controls=args.noise_controls, dtype=getattr(args, "dtype", "bfloat16"),
                       fingerprint_every=getattr(args, "fingerprint_every", 50))
    for case in cases:
        body = case.table.format(lr_105=LR * 1.05, lr_102=LR * 1.02, wd_102=WEIGHT_DECAY * 1.02)
        expect = 'expect = "fail"\n' if case.must_fail else ""
        text += f'\n[[sets]]\nname = "{case.name}"\n{expect}{body}\n'
    return text


def run_with_faults(text: str, folder: Path, faults: dict[str, str], label: str, run: bool = True):
    """Write a plan's TOML into `folder`, run it with the faults injected into the sets named in
    `faults` (set name -> benchmarks/faults name), and gather its curves: (plan, found)."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.toml"
    plan_path.write_text(text)
    plan = load_plan(plan_path)
    launches = plan.launches()
    os.environ["PROTOCOL_FAULTS"] = json.dumps({str(launch.output): faults[launch.name] for launch in launches
                                                if launch.name in faults})
    results = []
    if run:
        results = run_local(plan, launches, launcher=FAULT_LAUNCHER, rerun_stale=True,
                            on_progress=lambda line: print(f"  {label}: {line}", file=sys.stderr, flush=True))
    failed = [r.name for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{label}: runs failed: {', '.join(failed)}; see their protocol.log under {folder}")
    return plan, gather(plan, results, lambda path, name: read_curve(path, name=name))


def run_repeat(seed: int, cases: list[Case], args) -> dict:
    """One experiment: write its plan, run it, judge it; its curves stay under <out>/seed-<seed>."""
    folder = Path(args.out).resolve() / f"seed-{seed}"
    started = time.monotonic()
    _, found = run_with_faults(plan_text(cases, seed, folder / "runs", args), folder,
                               {case.name: case.fault for case in cases if case.fault}, f"seed {seed}",
                               run=not args.analyze)
    return {"seed": seed, "family": found.controls, "tests": found.tests, "expect": found.expect,
            "seconds": time.monotonic() - started}


def judge(repeat: dict, tolerance: Tolerance, members: int | None = None):
    """Every case judged as the one set of a plan of its own (the family and that set): the
    plan-level rule (Holm's step-down over the plan's sets) then sees the plan a user would run
    to test that layout, not one plan of every case at once."""
    family = repeat["family"][:members] if members else repeat["family"]
    alone = [compare(family, [test], tolerance, expect=repeat["expect"]) for test in repeat["tests"]]
    return replace(alone[0], results=[c.results[0] for c in alone],
                   fingerprints={name: where for c in alone for name, where in c.fingerprints.items()})


def case_rows(repeats: list[dict], cases: list[Case], tolerance: Tolerance) -> tuple[list[list], dict]:
    """One row per case (verdicts over the repeats, mean D / noise SD per observable), and the rates."""
    verdicts = {case.name: [] for case in cases}
    evidence = {case.name: {kind: 0 for kind in EVIDENCE} for case in cases}
    ratios = {(case.name, o): [] for case in cases for o in tolerance.observables}
    mde = {o: [] for o in tolerance.observables}
    for repeat in repeats:
        comparison = judge(repeat, tolerance)
        for noise in comparison.noise:
            mde[noise.observable].append(noise.mde)
        for result in comparison.results:
            verdicts[result.name].append(result.failed)
            for kind in result.evidence:
                evidence[result.name][kind] += 1
            for o in result.observables:
                ratios[(result.name, o.observable)].append(o.diff / o.noise_sd if o.noise_sd else math.inf)
    rows = []
    for case in cases:
        fails = sum(verdicts[case.name])
        n = len(verdicts[case.name])
        wrong = fails if not case.must_fail else n - fails
        rows.append([case.name, case.group, f"{n - fails} / {fails}", f"{wrong}/{n}",
                     " / ".join(str(evidence[case.name][kind]) for kind in EVIDENCE),
                     *[f"{mean(ratios[(case.name, o)]):+.1f}" for o in tolerance.observables]])
    rates = rates_of(verdicts, cases)
    rates["mde"] = {o: (mean(v), stdev(v)) for o, v in mde.items()}
    return rows, rates


EVIDENCE = ("curves", "fingerprints", "own noise")  # SetResult.evidence, in the table's order


def rates_of(verdicts: dict[str, list[bool]], cases: list[Case]) -> dict:
    correct = [failed for case in cases if not case.must_fail for failed in verdicts[case.name]]
    faulty = [not failed for case in cases if case.must_fail for failed in verdicts[case.name]]
    return {"false_fail": (sum(correct), len(correct)), "false_pass": (sum(faulty), len(faulty))}


def interval(hits: int, total: int) -> str:
    """The 95% Clopper-Pearson interval of a rate measured as hits / total."""
    from scipy import stats

    low = stats.beta.ppf(0.025, hits, total - hits + 1) if hits else 0.0
    high = stats.beta.ppf(0.975, hits + 1, total - hits) if hits < total else 1.0
    return f"{hits}/{total} (95% interval {low:.0%}-{high:.0%})"


def mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def stdev(values: list[float]) -> float:
    if len(values) < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def growth_rows(repeats: list[dict], tolerance: Tolerance) -> tuple[list[str], list[list]]:
    """RMS paired difference of the noise controls from the control at points of the run, averaged over repeats."""
    per_observable: dict[str, list[list[tuple[int, float]]]] = {}
    for repeat in repeats:
        for noise in judge(repeat, tolerance).noise:
            per_observable.setdefault(noise.observable, []).append(noise.growth)
    header, rows = ["observable"], []
    for observable, growths in per_observable.items():
        steps = [step for step, _ in growths[0]]
        header = ["observable", *[f"step {s}" for s in steps]]
        rows.append([observable, *[f"{mean([g[i][1] for g in growths]):.2e}" for i in range(len(steps))]])
    return header, rows


def truncated(curve, last_step: int):
    """The curve up to last_step, as if the run had stopped there (its schedule aside)."""
    import dataclasses

    keep = [i for i, step in enumerate(curve.steps) if step <= last_step]
    pick = lambda values: None if values is None else [values[i] for i in keep]  # noqa: E731
    return dataclasses.replace(curve, steps=pick(curve.steps), loss=pick(curve.loss), grad_norm=pick(curve.grad_norm),
                               extra={k: pick(v) for k, v in curve.extra.items()})


def scaling_rows(repeats: list[dict], tolerance: Tolerance, steps: int) -> list[list]:
    """Noise SD and detectable offset of each observable when the runs are cut at fewer steps
    (mean over repeats): how a plan's power depends on its length."""
    from protocol.verdict.statistical_mode import noise_summaries

    rows = []
    for last in sorted({max(20, steps // 6), steps // 3, 2 * steps // 3, steps}):
        figures: dict[str, list[tuple[float, float]]] = {}
        for repeat in repeats:
            for noise in noise_summaries([truncated(c, last) for c in repeat["family"]], tolerance):
                figures.setdefault(noise.observable, []).append((noise.noise_sd, noise.mde))
        rows.append([str(last), *[f"{mean([f[0] for f in figures[o]]):.2e} / {mean([f[1] for f in figures[o]]):.2e}"
                                  for o in tolerance.observables]])
    return rows


def settings_rows(repeats: list[dict], cases: list[Case], base: Tolerance) -> list[list]:
    """The rates re-judged under other settings, from the same runs."""
    rows = []
    most = len(repeats[0]["family"]) - 1
    for members in sorted({2, 3, most} & set(range(2, most + 1))):
        for sigmas in (3.0, 4.0, 5.0, 6.0):
            for window in (0.1, 0.2):
                tolerance = replace(base, margin_sigmas=sigmas, final_window=window)
                verdicts = {case.name: [] for case in cases}
                mde: dict[str, list[float]] = {o: [] for o in base.observables}
                for repeat in repeats:
                    comparison = judge(repeat, tolerance, members + 1)
                    for noise in comparison.noise:
                        mde[noise.observable].append(noise.mde)
                    for result in comparison.results:
                        verdicts[result.name].append(result.failed)
                rates = rates_of(verdicts, cases)
                default = Tolerance()
                shipped = (members, sigmas, window) == (default.noise_controls, default.margin_sigmas,
                                                         default.final_window)
                rows.append([f"{members}{' (shipped)' if shipped else ''}", f"{sigmas:g}", f"{window:g}",
                             "{}/{}".format(*rates["false_fail"]), "{}/{}".format(*rates["false_pass"]),
                             *[f"{mean(mde[o]):.2e}" for o in base.observables]])
    return rows


PLAN_LEVEL = Tolerance().plan_false_fail


def holm_fails(ratios, floor: float, dof: int) -> dict[int, "np.ndarray"]:
    """Per plan size n: which simulated plans of n correct sets fail anywhere under the shipped
    rule, Holm's step-down over their 2n observables at the plan level (protocol.verdict.family_wise;
    the drift test left out: correct sets do not drift)."""
    import numpy as np

    from protocol.verdict.family_wise import OFFSET_WEIGHT, holm
    from protocol.verdict.statistics import t_upper_tail

    found = {}
    for n in range(1, ratios.shape[1] + 1):
        failed = []
        for plan in ratios[:, :n].reshape(len(ratios), -1):
            p_values = [min(1.0, 2 * t_upper_tail(r, dof) / OFFSET_WEIGHT) for r in plan]
            failed.append(any(rejected and r > floor for r, (_, rejected) in zip(plan, holm(p_values, PLAN_LEVEL))))
        found[n] = np.array(failed)
    return found


def design_rows(plan_sets: tuple[int, ...] = (3, 4), experiments: int = 1500, window: int = 30,
                rho: float = 0.9) -> list[list]:
    """The rule's error rates and detectable offset for other noise controls and margins, from its
    own estimator on simulated curves (no runs): every run's final window is AR(1) noise with
    correlation rho, the family's noise SD is protocol.verdict.decision.noise_sd of their windows, and a
    correct set is one more such run. Per (K, margin): the chance that a correct set fails one
    observable, either of two, that a plan of `plan_sets` correct sets fails anywhere, and the
    stated detectable offset in units of the true noise SD of a correct set's difference; then the
    same plans under the plan-level rule (Holm's step-down, protocol.verdict.family_wise) and its
    detectable offset at the strictest threshold of a plan of max(plan_sets) sets."""
    import numpy as np
    from scipy import signal

    from protocol.verdict.decision import family_noise_sd
    from protocol.verdict.family_wise import offset_bound_sigmas
    from protocol.verdict.statistics import t_quantile

    rng = np.random.default_rng(0)
    scale = np.sqrt(1 - rho ** 2)  # shocks for a unit-variance AR(1)

    def runs(count: int) -> np.ndarray:
        shocks = rng.normal(0.0, scale, (count, window + 200))
        return signal.lfilter([1.0], [1.0, -rho], shocks, axis=1)[:, 200:]  # 200 steps of burn-in

    lags = np.arange(1, window)
    run_sd = np.sqrt((1 + 2 * np.sum((1 - lags / window) * rho ** lags)) / window)  # of one window mean
    rows = []
    for members in (2, 3, 4, 6, 8):
        t_crit, t_power = t_quantile(0.95, members), t_quantile(0.8, members)
        ratios = np.empty((experiments, max(plan_sets), 2))  # |D| / sigma
        sigmas = np.empty((experiments, 2))
        for e in range(experiments):
            for o in range(2):  # two observables, independent noise
                family = runs(members + 1)
                sigma = family_noise_sd(family)
                diffs = runs(max(plan_sets)).mean(axis=1) - family.mean()
                ratios[e, :, o] = np.abs(diffs) / sigma
                sigmas[e, o] = sigma
        true_sd = run_sd * np.sqrt(1 + 1 / (members + 1))
        for margin in (4.0, 5.0, 6.0):
            fails = ratios > margin - t_crit
            held = holm_fails(ratios, margin - t_crit, members)
            detectable = (margin - t_crit + t_power) * sigmas.mean() / true_sd
            strictest = max(margin - t_crit, offset_bound_sigmas(PLAN_LEVEL / (2 * max(plan_sets)), members))
            rows.append([str(members), f"{margin:g}", f"{fails[:, 0, 0].mean():.1%}", f"{fails[:, 0].any(1).mean():.1%}",
                         *[f"{fails[:, :n].any((1, 2)).mean():.1%}" for n in plan_sets],
                         *[f"{held[n].mean():.1%}" for n in plan_sets], f"{detectable:.2f}",
                         f"{(strictest + t_power) * sigmas.mean() / true_sd:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, help="experiments, seeds 0.. (default 5)")
    parser.add_argument("--first-seed", type=int, help="seed of the first experiment (default 0)")
    parser.add_argument("--steps", type=int, help="training steps of every run (default 300)")
    parser.add_argument("--noise-controls", type=int, help=f"default {Tolerance().noise_controls}, the shipped one")
    parser.add_argument("--dp", type=int, help="data-parallel degree of every run (default 2)")
    parser.add_argument("--local-batch", type=int, help="default 4")
    parser.add_argument("--dataset", default="synthetic_context", choices=("synthetic_context", "synthetic", "python_stdlib"),
                        help="the built-in source every run trains on (default synthetic_context, on which "
                             "attention and positions matter; python_stdlib: real text, docs/datasets.md)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="compute dtype of every run (default bfloat16)")
    parser.add_argument("--fingerprint-every", type=int, default=50,
                        help="fingerprints at steps 1-4 and every this many steps (default 50)")
    parser.add_argument("--final-window", type=float, default=Tolerance().final_window,
                        help="fraction of the steps whose mean is judged (default: the shipped tolerance's)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--out", default="outputs/protocol_power", help="folder of the runs (reused when current)")
    parser.add_argument("--json", help="write the figures as JSON here")
    parser.add_argument("--analyze", action="store_true", help="judge the runs already in --out, run nothing")
    parser.add_argument("--design-table", action="store_true",
                        help="print the false-fail rates and detectable offsets the rule implies for other noise "
                             "controls and margins (no runs), and exit")
    parser.add_argument("--quick", action="store_true", help="the test suite's version (options given explicitly still "
                                                             "apply): 1 repeat, 100 steps, DP 1 x local batch 8, 3 "
                                                             "noise controls, " + " and ".join(QUICK_CASES))
    args = parser.parse_args()
    if args.design_table:
        print(table(["noise controls", "margin_sigmas", "one observable", "a set (2 observables)",
                     "a plan of 3 sets, per set", "a plan of 4 sets, per set", "a plan of 3 sets, plan-level",
                     "a plan of 4 sets, plan-level", "detectable offset / noise SD, per set",
                     "detectable offset / noise SD, plan of 4 sets"], design_rows()))
        return
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) in (None, ""):
            setattr(args, key, value)
    chosen = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in {c.name for c in CASES}]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CASES)}")
    cases = [c for c in CASES if not chosen or c.name in chosen]
    tolerance = replace(Tolerance(mode="statistical"), noise_controls=args.noise_controls,
                        final_window=args.final_window)

    seeds = range(args.first_seed, args.first_seed + args.repeats)
    repeats = [run_repeat(seed, cases, args) for seed in seeds]
    rows, rates = case_rows(repeats, cases, tolerance)
    print(f"Protocol power study: {machine()}; tiny Llama, bfloat16, seq_len 64, DP {args.dp} x local batch "
          f"{args.local_batch}, {args.steps} steps, {args.repeats} repeat(s) (seeds {seeds[0]}-{seeds[-1]}), "
          f"{args.noise_controls} noise controls, "
          + ("judged from the runs in --out" if args.analyze else f"{sum(r['seconds'] for r in repeats) / 60:.0f} min of runs"))
    print()
    print(table(["case", "group", "PASS / FAIL", "wrong verdicts", "failed on " + " / ".join(EVIDENCE),
                 *[f"{o} diff / noise SD" for o in tolerance.observables]], rows,
                "llrrr" + "r" * len(tolerance.observables)))
    print()
    ff, pf = rates["false_fail"], rates["false_pass"]
    print(f"false-fail rate (correct layouts that failed): {interval(*ff)}; false-pass rate (faults that passed): "
          f"{interval(*pf)}")
    print("minimum detectable final-window offset (mean over repeats, and their sd): "
          + "; ".join(f"{o} {m:.2e}" + (f" ({s:.1e})" if math.isfinite(s) else "") for o, (m, s) in rates["mde"].items()))
    header, growth = growth_rows(repeats, tolerance)
    print()
    print("noise controls' paired difference from the control (RMS around the step, mean over repeats):")
    print(table(header, growth))
    scaling = scaling_rows(repeats, tolerance, args.steps)
    print()
    print("noise SD / detectable offset of the final-window mean when the runs are cut at fewer steps:")
    print(table(["steps", *tolerance.observables], scaling))
    settings = settings_rows(repeats, cases, tolerance)
    print()
    print("the same runs judged with other settings (detectable offsets: mean over repeats):")
    print(table(["noise controls", "margin_sigmas", "final_window", "false fail", "false pass",
                 *[f"{o} detectable" for o in tolerance.observables]], settings, "lrrrr" + "r" * len(tolerance.observables)))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cases": {row[0]: row[1:] for row in rows}, "false_fail": ff, "false_pass": pf, "mde": rates["mde"],
            "growth": growth, "scaling": scaling, "settings": settings,
            "verdicts": [verdict_record(r["seed"], judge(r, tolerance)) for r in repeats]}, indent=1))


def verdict_record(seed: int, comparison) -> dict:
    """One repeat's verdicts, and where each set parts from the control (its fingerprints)."""
    return {"seed": seed, "results": [{"name": x.name, "outcome": x.outcome, "reason": x.reason}
                                      for x in comparison.results],
            "fingerprints": {name: as_dict(where) for name, where in comparison.fingerprints.items()}}


if __name__ == "__main__":
    main()
