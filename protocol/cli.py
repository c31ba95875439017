"""`protocol plan | run | compare`: from a convergence test plan to launches, runs and a verdict.

    protocol plan PLAN.toml [--format table|json|shell|slurm] [--out DIR]
    protocol run PLAN.toml [--only NAME,...] [--launcher local|slurm [--poll SECONDS]] [--rerun-stale] [--compare]
    protocol compare PLAN.toml [--only NAME,...] [--out DIR]
    protocol compare [PLAN.toml] --control DIR [--noise DIR ...] --test [NAME=]DIR [...] [--mode ...] ...
    protocol compare --unpaired --control DIR --control DIR --control DIR --test [NAME=]DIR ...

Exit codes: 0 success (compare: every set passes and every positive control fails), 1 a run failed
or a set failed, 2 a user error (bad plan, missing folder, unknown name, a folder that cannot be
written, stale runs without --rerun-stale, runs that cannot be paired), 3 inconclusive (a positive
control passed: the plan could not have caught a bug of that size), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from protocol.plan.tolerance import MODES, Tolerance, tolerance_keys

log = logging.getLogger("protocol")


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from trainer import messages
    from trainer.version import require_supported_torch  # a torch outside the tested range: one line, exit 2

    require_supported_torch()
    messages.configure()
    try:
        status = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `protocol plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a folder or file that cannot be written: the path and why, no traceback
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="protocol", description="Convergence protocol: a 1D FSDP control vs N-D "
                                  "test sets at fixed local batch and DP degree, from a plan to a verdict.")
    commands = top.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="validate a plan and print its launches")
    plan.add_argument("plan", type=Path, help="plan TOML (see docs/protocol_plan_file.md)")
    plan.add_argument("--format", choices=("table", "json", "shell", "slurm"), default="table",
                      help="table (default), json, shell (a runnable script) or slurm (sbatch scripts, needs --out)")
    plan.add_argument("--out", type=Path, help="folder for the slurm scripts")
    plan.set_defaults(handler=cmd_plan)

    run = commands.add_parser("run", help="create the seed checkpoint, then run the control and the test sets")
    run.add_argument("plan", type=Path)
    run.add_argument("--only", default="", help="comma-separated run names (see `protocol plan`)")
    run.add_argument("--launcher", choices=("local", "slurm"), default="local",
                     help="local: one run after another on this node; slurm: submit and wait")
    run.add_argument("--rerun-stale", action="store_true",
                     help="run again the runs made with other options, code or seed checkpoint than the plan's "
                          "now (their folders move to <output>/superseded/); without it such runs are refused")
    run.add_argument("--compare", action="store_true",
                     help="compare and write the report when the runs are done (failed runs are FAILED rows)")
    run.add_argument("--poll", type=float, default=60.0, metavar="SECONDS",
                     help="--launcher slurm: seconds between looks at the queue (default 60)")
    run.set_defaults(handler=cmd_run)

    compare = commands.add_parser("compare", help="compare the curves with the control and give a verdict")
    compare.add_argument("plan", type=Path, nargs="?", help="plan TOML whose runs to compare (with --control/--test: "
                         "whose tolerances to use)")
    compare.add_argument("--only", default="", help="comma-separated set names: compare these (and the control family)")
    compare.add_argument("--control", type=Path, action="append", default=[],
                         help="control run folder, metrics.jsonl or TensorBoard folder (--unpaired: repeat it for "
                              "each seed repeat)")
    compare.add_argument("--noise", type=Path, action="append", default=[],
                         help="a noise control of --control (same data and weights, perturbed); repeat for each")
    compare.add_argument("--test", action="append", default=[], metavar="[NAME=]PATH", help="a test set's curves")
    compare.add_argument("--unpaired", action="store_true",
                         help="the runs did not train on the same data (e.g. another trainer's seed repeats): judge "
                              "against the spread of the --control repeats")
    compare.add_argument("--out", type=Path, help="report folder (default: the plan's output folder, or ./report)")
    compare.add_argument("--loss-tag", help="TensorBoard tag of the loss (default: this trainer's or torchtitan's)")
    compare.add_argument("--grad-norm-tag", help="TensorBoard tag of the gradient norm")
    for name, kind in judging_keys().items():
        default = getattr(Tolerance(), name)
        kwargs = {"choices": MODES} if name == "mode" else {"type": comma_list if kind is list else kind}
        compare.add_argument("--" + name.replace("_", "-"), dest=f"tolerance_{name}", help=f"tolerance.{name} (default "
                             f"{','.join(default) if kind is list else repr(default)}, or the plan's)", **kwargs)
    compare.set_defaults(handler=cmd_compare)
    return top


# [tolerance] keys that decide which runs a plan makes, not how they are judged: not compare options.
RUN_KEYS = ("noise_controls", "perturbation")


def judging_keys() -> dict[str, type]:
    return {name: kind for name, kind in tolerance_keys().items() if name not in RUN_KEYS}


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def names(text: str) -> list[str] | None:
    return [name.strip() for name in text.split(",") if name.strip()] or None


def load(path: Path):
    from protocol.plan.load import load_plan

    if not path.is_file():
        raise UsageError(f"{path}: no such plan file")
    return load_plan(path)


def output_folder(path: Path, what: str) -> Path:
    """`path`, created if need be; a UsageError naming `what` when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{what} {path}: exists and is not a folder; give a folder") from None
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot create the folder ({e.strerror}); give a writable folder") from None
    return path


def cmd_plan(args) -> int:
    from protocol.run.render import render
    from protocol.run.sbatch import check_scripts_folder, write_slurm

    if args.out is not None and args.format != "slurm":
        raise UsageError(f"--out is the folder of --format slurm's scripts; --format {args.format} prints to "
                         "standard output (redirect it to a file instead)")
    plan = load(args.plan)
    launches = plan.launches()
    if args.format == "slurm":
        if args.out is None:
            raise UsageError("--format slurm writes one sbatch script per run: give the folder with --out DIR")
        check_scripts_folder(args.out)  # before the folder is made
        for path in write_slurm(plan, launches, output_folder(args.out, "--out"),
                                lambda note: print(f"note: {note}", file=sys.stderr)):
            print(path)
        return 0
    print(render(plan, launches, args.format))
    return 0


def cmd_run(args) -> int:
    from protocol.plan.model import SLURM_DIR
    from protocol.run.local import run_local
    from protocol.run.slurm import run_slurm

    if args.poll <= 0:
        raise UsageError(f"--poll: {args.poll:g} is not a number of seconds; give a positive number, e.g. 60")
    if args.launcher == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--launcher slurm: sbatch is not on PATH; run this on a SLURM login node, or write the "
                         "scripts with `protocol plan PLAN --format slurm --out DIR`")
    plan = load(args.plan)
    launches = plan.launches()
    only = names(args.only)
    output_folder(plan.output, f"{args.plan}: plan.output")
    if args.launcher == "slurm":
        results = run_slurm(plan, launches, plan.output / SLURM_DIR, only=only, rerun_stale=args.rerun_stale,
                            poll=args.poll)
    else:
        results = run_local(plan, launches, only=only, on_progress=log.info, rerun_stale=args.rerun_stale)
    status = 1 if any(r.failed for r in results) else 0
    if args.compare:
        verdict_status = compare_plan(plan, out=None, overrides={}, results=results, only=only)
        status = verdict_status if verdict_status != 0 else status
    return status


def cmd_compare(args) -> int:
    overrides = {name: getattr(args, f"tolerance_{name}") for name in judging_keys()
                 if getattr(args, f"tolerance_{name}") is not None}
    tags = {"loss_tag": args.loss_tag, "grad_norm_tag": args.grad_norm_tag}
    plan = load(args.plan) if args.plan is not None else None
    if not args.control and not args.test and not args.noise:
        if plan is None:
            raise UsageError("compare needs a plan, or --control PATH and at least one --test [NAME=]PATH")
        if args.unpaired:
            raise UsageError("--unpaired compares folders given with --control/--test; a plan's runs are paired")
        return compare_plan(plan, args.out, overrides, only=names(args.only), **tags)
    if args.only:
        raise UsageError("--only chooses among a plan's sets; with --control/--test give just the folders to compare")
    if not args.control or not args.test:
        raise UsageError("give --control PATH and at least one --test [NAME=]PATH")
    from protocol.verdict.adhoc import compare_folders

    if plan is None and "mode" not in overrides and (args.noise or args.unpaired):
        overrides["mode"] = "statistical"  # noise controls and seed repeats are only for that
    base = plan.tolerance if plan is not None else Tolerance()
    tolerance = replace(base, **overrides)
    problems = tolerance.problems()
    if problems:
        raise UsageError("; ".join(problems))
    result = compare_folders(args.control, args.noise, [split_test(spec) for spec in args.test], tolerance,
                             unpaired=args.unpaired, reader=lambda path, name: read(path, name, **tags))
    return report(result.comparison, result.family, result.tests, args.out or Path("report"), "--out", result.layouts,
                  result.runs)


def split_test(spec: str) -> tuple[Path, str | None]:
    name, sep, path = spec.partition("=")
    return (Path(path), name) if sep else (Path(spec), None)


def read(path: Path, name: str | None, loss_tag=None, grad_norm_tag=None):
    from protocol.verdict.curves import read_curve

    return read_curve(path, name=name, loss_tag=loss_tag, grad_norm_tag=grad_norm_tag)


def compare_plan(plan, out: Path | None, overrides: dict, loss_tag=None, grad_norm_tag=None, results=(),
                 only=None) -> int:
    """The plan's runs compared; the report goes to `out`, by default the plan's output folder.

    `results` are those of `protocol run`: a run that failed or was skipped there is a FAILED or
    NOT RUN row, as is a run that has no metrics.jsonl. Every row is described from its run's
    own record. `only` limits the sets compared (the control family is always read).
    """
    from protocol.run.reuse import stale_notes
    from protocol.verdict.compare import compare, nothing_to_compare
    from protocol.verdict.gather import gather, numerics_warnings

    tolerance = replace(plan.tolerance, **overrides)
    problems = tolerance.problems()
    if problems:
        raise UsageError("; ".join(problems))
    found = gather(plan, results, lambda path, name: read(path, name, loss_tag, grad_norm_tag), only=only)
    found.notes = stale_notes(plan, [run.name for run in found.runs if run.recorded])
    where = "--out" if out else f"{plan.path}: plan.output"
    needed = tolerance.noise_controls + 1 if tolerance.mode == "statistical" else 1
    family_complete = len(found.controls) >= (3 if tolerance.mode == "statistical" else 1)
    if not family_complete:
        note = found.control_note(needed)
        comparison = nothing_to_compare(plan.control.name, tolerance, found.not_compared, note)
        return report(comparison, [], [], out or plan.output, where, found.layouts(), found.runs, found.notes)
    # A criterion judges runs that need not agree step by step (bf16 on GPUs): no exact-mode warning.
    warnings = numerics_warnings(found.runs) if tolerance.mode == "exact" and plan.criterion is None else []
    left_out = [spec.name for spec in plan.sets if spec.expect == "fail" and spec.name not in found.expect]
    if left_out:
        warnings.append(f"positive control{'s' if len(left_out) > 1 else ''} {', '.join(left_out)} not compared "
                        "(--only): this verdict does not show what the plan can catch")
    comparison = compare(found.controls, found.tests, tolerance, expect=found.expect,
                         not_compared=found.not_compared, warnings=warnings, localize_only=found.localize_only)
    sweeps, runs = None, found.runs
    if plan.criterion is not None:
        from protocol.verdict.by_criterion import judge_by_criterion

        verdict = judge_by_criterion(plan, comparison)
        comparison, sweeps = verdict.comparison, (verdict.sweeps, verdict.bound)
        runs = [run for run in runs if run.name not in verdict.unneeded]  # never ran: the search did not need them
    return report(comparison, found.controls, found.tests, out or plan.output, where, found.layouts(), runs,
                  found.notes, sweeps)


EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def report(comparison, family, tests, out: Path, out_name: str, layouts: dict, runs=None, notes=None,
           sweeps=None) -> int:
    """Write the report into `out` (named `out_name` in errors), print the table, the files and
    the verdict; the exit code (0 PASS, 1 FAIL, 3 INCONCLUSIVE). `sweeps`: (the sweep report, the
    criterion's bound) of a plan with a criterion, written and printed too."""
    from protocol.report.markdown import format_table, status_line, write_report

    paths = write_report(comparison, family, tests, output_folder(out, out_name), layouts=layouts, runs=runs,
                         notes=notes)
    if sweeps and sweeps[0].tables:
        from protocol.report.sweeps import plain, write_sweep_report

        paths.update(write_sweep_report(sweeps[0], sweeps[1], out))
    for warning in comparison.warnings:
        print(f"warning: {warning}")
    if comparison.note:
        print(f"FAIL: {comparison.note}")
    print(format_table(comparison, layouts))
    for name, where in comparison.fingerprints.items():  # where each set that parts does so
        if where.deviates:
            print(f"where: {name}: {where.summary()}")
    if sweeps and sweeps[0].tables:
        print(plain(sweeps[0]))
    for path in paths.values():
        print(f"wrote {path}")
    if notes:  # the verdict is about what ran, which is not what the plan says now
        differing = {name: found for name, found in notes.items() if found}
        if differing:
            print(f"note: {len(differing)} run(s) differ from the plan as written now; the rows describe what they "
                  "ran (`protocol run PLAN --rerun-stale` runs them again):")
            for name, found in differing.items():
                print(f"  {name}: {'; '.join(found)}")
    print(status_line(comparison))
    return EXIT_CODES[comparison.status]


if __name__ == "__main__":
    sys.exit(main())
