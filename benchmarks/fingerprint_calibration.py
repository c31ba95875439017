"""How often do correct layouts fail on their fingerprints? The statistical threshold, measured.

    python benchmarks/fingerprint_calibration.py [--datasets synthetic_context,python_stdlib]
        [--dtypes bfloat16,float32] [--seeds 0] [--steps 300] [--fingerprint-every 25]
        [--dp 1] [--local-batch 8] [--out DIR] [--json FILE] [--analyze]

For each data set, compute dtype and seed, one statistical plan of correct layouts only (the tiny
Llama, seq_len 64, seed checkpoint, 4 noise controls; TP 2, PP 2 Interleaved1F1B, CP 2 and TP 2 x
PP 2 as its sets; fingerprints at steps 1-4 and every --fingerprint-every steps), run by the
protocol's own local runner and judged by `protocol compare`'s own code. A correct set's
fingerprints should fail the plan in at most 1% of plans (protocol.verdict.fingerprint_noise).
Prints, per (data set, dtype): the correct sets and set-steps compared, how many failed and on
what evidence (and how many would have failed at Student's t threshold without LAYOUT_TAILS),
the largest score of any entry (1 = the family-wise threshold), and the share of
all entries beyond 3 and 4 of their noise units against what Student's t with the units' degrees
of freedom gives (the threshold assumes that tail); and the largest own-noise ratio of a set's
curves (compare.OWN_NOISE_FAILS).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

from common import machine, table  # noqa: I001 (sets sys.path)
from protocol_power import CASES, plan_text, run_with_faults

from protocol.plan.tolerance import Tolerance
from protocol.verdict.compare import compare
from protocol.verdict.fingerprint_noise import LAYOUT_TAILS
from protocol.verdict.fingerprints import family_fit, read_fingerprints, relative_differences, run_folder
from protocol.verdict.statistics import t_upper_tail

CORRECT = [case for case in CASES if not case.must_fail]
TAILS = (3.0, 4.0)


def run_plan(dataset: str, dtype: str, seed: int, args) -> dict:
    """Run (or, with --analyze, read) one plan of the correct layouts; its runs stay under --out."""
    folder = Path(args.out).resolve() / f"{dataset}-{dtype}-seed-{seed}"
    options = SimpleNamespace(steps=args.steps, local_batch=args.local_batch, dp=args.dp, dataset=dataset,
                              noise_controls=args.noise_controls, dtype=dtype, fingerprint_every=args.fingerprint_every)
    _, found = run_with_faults(plan_text(CORRECT, seed, folder / "runs", options), folder, {},
                               f"{dataset} {dtype} seed {seed}", run=not args.analyze)
    return {"dataset": dataset, "dtype": dtype, "seed": seed, "family": found.controls, "tests": found.tests}


def z_values(family: list, tests: list) -> list[tuple[float, float]]:
    """(|difference from the family mean| / noise unit, the unit's degrees of freedom) of every
    entry of every compared step of every set, as protocol compare scores them before the threshold."""
    prints = [read_fingerprints(run_folder(c)) for c in family]
    values = []
    for test in tests:
        mine = read_fingerprints(run_folder(test))
        steps = sorted(set(mine).intersection(*(set(p) for p in prints)))
        mean, model = family_fit(prints, steps)
        for s in steps:
            for key, value in relative_differences(mean[s], mine[s]).items():
                unit = model.unit(key, s)
                if unit > 0:
                    values.append((abs(value) / unit, model.dof(key[0])))
    return values


def summarize(plans: list[dict], tolerance: Tolerance) -> tuple[list[list[str]], list[dict]]:
    rows, records = [], []
    for dataset, dtype in dict.fromkeys((p["dataset"], p["dtype"]) for p in plans):
        mine = [p for p in plans if (p["dataset"], p["dtype"]) == (dataset, dtype)]
        sets = steps = 0
        failed, peaks, ratios, zs = [], [], [], []
        for plan in mine:
            comparison = compare(plan["family"], plan["tests"], tolerance)
            for result in comparison.results:
                where = comparison.fingerprints[result.name]
                sets += 1
                steps += len(where.steps)
                peaks.append(where.peak)
                ratios.append(max(o.noise_ratio for o in result.observables))
                if result.failed:
                    failed.append(f"{result.name} ({'+'.join(result.evidence)})")
                records.append({"dataset": dataset, "dtype": dtype, "seed": plan["seed"], "set": result.name,
                                "steps": len(where.steps), "peak": where.peak, "peak_at": where.peak_at,
                                "thresholds": where.thresholds, "noise_ratio": ratios[-1],
                                "failed": result.failed, "evidence": result.evidence, "reason": result.reason})
            zs += z_values(plan["family"], plan["tests"])
        tails = [f"{sum(z > t for z, _ in zs) / len(zs):.2%} ({sum(2 * t_upper_tail(t, d) for _, d in zs) / len(zs):.2%})"
                 for t in TAILS]
        rows.append([dataset, dtype, str(len(mine)), str(sets), str(steps), f"{len(failed)}" +
                     (f": {', '.join(failed)}" if failed else ""), str(sum(p * LAYOUT_TAILS > 1 for p in peaks)),
                     f"{max(peaks):.2f}", f"{sorted(peaks)[len(peaks) // 2]:.2f}",
                     str(len(zs)), *tails, f"{max(ratios):.2f}"])
    return rows, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="synthetic_context,python_stdlib")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--seeds", default="0", help="comma-separated data and seed-checkpoint seeds")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fingerprint-every", type=int, default=25)
    parser.add_argument("--noise-controls", type=int, default=Tolerance().noise_controls)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--final-window", type=float, default=0.2, help="as cpu_statistical.toml (default 0.2)")
    parser.add_argument("--out", default="outputs/fingerprint_calibration")
    parser.add_argument("--json", help="write every set's figures here")
    parser.add_argument("--analyze", action="store_true", help="judge the runs already in --out, run nothing")
    args = parser.parse_args()
    tolerance = Tolerance(mode="statistical", noise_controls=args.noise_controls, final_window=args.final_window)
    plans = [run_plan(dataset, dtype, int(seed), args) for dataset in args.datasets.split(",")
             for dtype in args.dtypes.split(",") for seed in args.seeds.split(",")]
    rows, records = summarize(plans, tolerance)
    print(f"Fingerprint calibration: {machine()}; tiny Llama, seq_len 64, DP {args.dp} x local batch "
          f"{args.local_batch}, {args.steps} steps, fingerprints at steps 1-4 and every {args.fingerprint_every}, "
          f"{args.noise_controls} noise controls, seeds {args.seeds}; correct sets: "
          + ", ".join(case.name for case in CORRECT))
    print()
    print(table(["data", "dtype", "plans", "correct sets", "set-steps", "sets failed",
                 f"failed at t's threshold alone (not x{LAYOUT_TAILS:g})", "largest score",
                 "median set's largest", "entries", *[f"beyond {t:g} units (t)" for t in TAILS],
                 "largest own-noise ratio"], rows, "llrrrlrrrrrrr"))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1, default=lambda v: None if not math.isfinite(v) else v))


if __name__ == "__main__":
    main()
