"""Does the protocol say *where* a layout goes wrong? Injected bugs against per-module fingerprints.

    python benchmarks/fingerprint_localization.py [--steps 3] [--dtypes float32,bfloat16]
                                                  [--cases NAME,...] [--out DIR] [--json FILE]

For each compute dtype, one plan of short runs (the tiny Llama, synthetic_context, seed checkpoint,
fingerprints at every step) run by the protocol's own local runner: the 1D FSDP control (in
bfloat16 with its 4 noise controls: statistical mode; in float32 exact mode), correct layouts, and
one set per bug of benchmarks/faults (the shipped trainer cannot enable them). Each set's
fingerprints are compared with the control's as `protocol compare` does
(protocol.verdict.fingerprints.localize_sets). Prints one row per (case, dtype): the first step at
which the set deviates, the top-ranked cause the report names, whether that is the module the bug
is in, and the report's sentence; correct layouts must show no deviation (a false alarm otherwise).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine, table  # noqa: I001 (sets sys.path)
from protocol_power import run_with_faults

from protocol.verdict.fingerprints import localize_sets


@dataclass(frozen=True)
class Case:
    name: str
    layout: str  # the [[sets]] body, TOML
    fault: str | None  # benchmarks/faults/faults_catalog.py; None: a correct layout
    culprits: tuple[str, ...] = ()  # module patterns the top-ranked cause may name ("" : the norm check)
    blocks: tuple[str, ...] = ()  # the blocks it must name, when the bug is in one block

    def right(self, cause) -> bool:
        if cause is None:
            return False
        return cause.pattern in self.culprits and (not self.blocks or cause.blocks == self.blocks)


TP2, CP2 = 'kind = "parallelism"\ntp = 2', 'kind = "parallelism"\ncp = 2'
NORMS = ("norm.weight", "layers.*.attention_norm.weight", "layers.*.ffn_norm.weight")
CASES = [
    Case("TP2", TP2, None),
    Case("CP2", CP2, None),
    Case("PP2 Interleaved1F1B", 'kind = "parallelism"\npp = 2\npp_schedule = "Interleaved1F1B"', None),
    Case("TP2 norm grad not reduced", TP2, "tp_norm_grad_unreduced", NORMS),
    Case("TP2 w2 grad doubled in block 2", TP2, "tp_w2_grad_doubled_in_one_block",
         ("layers.*.feed_forward.w2.weight",), ("2",)),
    Case("CP2 RoPE unshifted", CP2, "cp_rope_unshifted", ("layers.*.attention.wq.weight", "layers.*.attention.wk.weight")),
    Case("CP2 RoPE tail chunk misplaced", CP2, "cp_rope_tail_misplaced",
         ("layers.*.attention.wq.weight", "layers.*.attention.wk.weight")),
    Case("TP2 RoPE half the keys shifted", TP2, "tp_rope_half_keys",
         ("layers.*.attention.wq.weight", "layers.*.attention.wk.weight")),
    Case("CP2 K/V grad not reduced", CP2, "cp_kv_grad_unreduced",
         ("layers.*.attention.wk.weight", "layers.*.attention.wv.weight")),
    Case("FSDP grads averaged (under TP2)", TP2, "fsdp_grad_averaged", ("every parameter",)),
    Case("TP2 norm counts replicas", TP2, "norm_counts_replicas", ("",)),
]

PLAN = """
[plan]
name = "fingerprints-{dtype}"
config = "debug_model.toml"
output = "{output}"
steps = {steps}
warmup_steps = 2
local_batch_size = 4
dp_degree = 2
seed = 0
gpus_per_node = 8

[plan.overrides]
"model.flavor" = "tiny"
"training.seq_len" = 64
"training.dataset" = "{dataset}"
"training.mixed_precision_param" = "{dtype}"
"optimizer.lr" = 3e-3
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"metrics.fingerprint_first" = {steps}
"debug.deterministic" = true

[tolerance]
mode = "{mode}"
{noise}
"""


def plan_text(cases: list[Case], dtype: str, output: Path, steps: int, dataset: str = "synthetic_context") -> str:
    statistical = dtype != "float32"
    text = PLAN.format(dtype=dtype, output=output, steps=steps, dataset=dataset,
                       mode="statistical" if statistical else "exact",
                       noise="noise_controls = 4" if statistical else "")
    for case in cases:
        text += f'\n[[sets]]\nname = "{case.name}"\n{case.layout}\n'
    return text


def run_dtype(cases: list[Case], dtype: str, args) -> list[list[str]]:
    folder = Path(args.out).resolve() / f"{args.dataset}-{dtype}"
    plan, found = run_with_faults(plan_text(cases, dtype, folder / "runs", args.steps, args.dataset), folder,
                                  {case.name: case.fault for case in cases if case.fault}, dtype)
    localized = localize_sets(found.controls, found.tests, plan.tolerance.mode)
    rows = []
    for case in cases:
        where = localized.get(case.name)
        if where is None:
            raise SystemExit(f"{dtype}: {case.name} recorded no fingerprints")
        causes = where.causes
        top = causes[0] if causes else None
        if case.fault is None:
            verdict = "no alarm" if not where.deviates else "FALSE ALARM"
        elif case.culprits == ("",):
            verdict = "yes" if where.norm_check and where.first_step is None else "no"
        else:
            verdict = "yes" if case.right(top) and where.first_step in (1, 2) else "no"
        named = "the global norm's reduction" if case.culprits == ("",) and where.norm_check else \
            (f"{top.pattern} {top.quantity}" + (f" (block {', '.join(top.blocks)})" if top.blocks and top.blocks != ("",)
                                                 and len(top.blocks) < top.of else "") if top else "-")
        rows.append([case.name, dtype, where.mode, str(where.first_step or "-"), named, verdict, where.summary()])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps per run, all recorded (default 3)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes (float32: exact mode)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--dataset", default="synthetic_context", choices=("synthetic_context", "python_stdlib"),
                        help="what every run trains on (python_stdlib: real text, docs/datasets.md)")
    parser.add_argument("--out", default="outputs/fingerprint_localization", help="where the runs go")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.cases or c.name in args.cases.split(",")]
    started = time.monotonic()
    rows = [row for dtype in args.dtypes.split(",") for row in run_dtype(chosen, dtype, args)]
    print(f"tiny Llama, {args.dataset}, seq_len 64, {args.steps} steps, DP 2, local batch 4; {machine()}; "
          f"{time.monotonic() - started:.0f} s")
    print(table(["case", "dtype", "mode", "first step", "top-ranked cause", "right?"], [r[:6] for r in rows]))
    print()
    for row in rows:
        print(f"- {row[0]} ({row[1]}): {row[6]}")
    wrong = [f"{r[0]} ({r[1]})" for r in rows if r[5] in ("no", "FALSE ALARM")]
    print(f"\n{len(rows) - len(wrong)} of {len(rows)} right" + (f"; wrong: {', '.join(wrong)}" if wrong else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
