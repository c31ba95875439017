"""`protocol plan | run | compare`: from a convergence test plan to launches, runs and a verdict.

    protocol plan PLAN.toml [--format table|json|shell|slurm] [--out DIR]
    protocol run PLAN.toml [--only NAME,...] [--launcher local|slurm] [--rerun-stale] [--compare]
    protocol compare PLAN.toml [--out DIR]
    protocol compare --control DIR [--control DIR ...] --test [NAME=]DIR [...] [--mode exact|statistical] ...

Exit codes: 0 success (compare: every set passes), 1 a run failed or a set failed, 2 a user error
(bad plan, missing folder, unknown name, a folder that cannot be written, stale runs without
--rerun-stale), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import fields, replace
from pathlib import Path

from protocol.tolerance import MODES, Tolerance

log = logging.getLogger("protocol")


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parser().parse_args(argv)
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
    plan.add_argument("plan", type=Path, help="plan TOML (see docs/converging.md)")
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
    run.set_defaults(handler=cmd_run)

    compare = commands.add_parser("compare", help="compare the loss curves with the control and give a verdict")
    compare.add_argument("plan", type=Path, nargs="?", help="plan TOML whose runs to compare")
    compare.add_argument("--control", type=Path, action="append", default=[],
                         help="control run folder, metrics.jsonl or TensorBoard folder (repeat for seed repeats)")
    compare.add_argument("--test", action="append", default=[], metavar="[NAME=]PATH", help="a test set's curves")
    compare.add_argument("--out", type=Path, help="report folder (default: the plan's output folder, or ./report)")
    compare.add_argument("--loss-tag", help="TensorBoard tag of the loss (default: this trainer's or torchtitan's)")
    compare.add_argument("--grad-norm-tag", help="TensorBoard tag of the gradient norm")
    for item in fields(Tolerance):
        flag = "--" + item.name.replace("_", "-")
        kwargs = {"choices": MODES} if item.name == "mode" else {"type": type(item.default)}
        compare.add_argument(flag, dest=f"tolerance_{item.name}", help=f"tolerance.{item.name} (default "
                             f"{item.default!r}, or the plan's)", **kwargs)
    compare.set_defaults(handler=cmd_compare)
    return top


def load(path: Path):
    from protocol.plan_file import load_plan

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
    from protocol.render import render
    from protocol.sbatch import write_slurm

    if args.out is not None and args.format != "slurm":
        raise UsageError(f"--out is the folder of --format slurm's scripts; --format {args.format} prints to "
                         "standard output (redirect it to a file instead)")
    plan = load(args.plan)
    launches = plan.launches()
    if args.format == "slurm":
        if args.out is None:
            raise UsageError("--format slurm writes one sbatch script per run: give the folder with --out DIR")
        for path in write_slurm(plan, launches, output_folder(args.out, "--out")):
            print(path)
        return 0
    print(render(plan, launches, args.format))
    return 0


def cmd_run(args) -> int:
    from protocol.local import run_local
    from protocol.plan import SLURM_DIR
    from protocol.slurm import run_slurm

    if args.launcher == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--launcher slurm: sbatch is not on PATH; run this on a SLURM login node, or write the "
                         "scripts with `protocol plan PLAN --format slurm --out DIR`")
    plan = load(args.plan)
    launches = plan.launches()
    only = [name.strip() for name in args.only.split(",") if name.strip()] or None
    output_folder(plan.output, f"{args.plan}: plan.output")
    if args.launcher == "slurm":
        results = run_slurm(plan, launches, plan.output / SLURM_DIR, only=only, rerun_stale=args.rerun_stale)
    else:
        results = run_local(plan, launches, only=only, on_progress=log.info, rerun_stale=args.rerun_stale)
    status = 1 if any(not r.ok for r in results) else 0
    if args.compare:
        status = max(status, compare_plan(plan, out=None, overrides={}, results=results))
    return status


def cmd_compare(args) -> int:
    from protocol.plan_report import folder_layouts

    overrides = {item.name: getattr(args, f"tolerance_{item.name}") for item in fields(Tolerance)
                 if getattr(args, f"tolerance_{item.name}") is not None}
    tags = {"loss_tag": args.loss_tag, "grad_norm_tag": args.grad_norm_tag}
    if args.plan is not None:
        if args.control or args.test:
            raise UsageError("give either a plan or --control/--test folders, not both")
        return compare_plan(load(args.plan), args.out, overrides, **tags)
    if not args.control or not args.test:
        raise UsageError("compare needs a plan, or --control PATH and at least one --test [NAME=]PATH")
    tolerance = replace(Tolerance(), **overrides)
    problems = tolerance.problems()
    if problems:
        raise UsageError("; ".join(problems))
    controls = [read(path, None, **tags) for path in args.control]
    test_paths = [split_test(spec) for spec in args.test]
    tests = [read(path, name, **tags) for path, name in test_paths]
    paths = {curve.name: path for curve, path in zip(controls, args.control)}
    paths.update({curve.name: path for curve, (path, _) in zip(tests, test_paths)})
    layouts = folder_layouts(paths, controls[0].name)
    return compare_and_report(controls, tests, tolerance, args.out or Path("report"), "--out", layouts)


def split_test(spec: str) -> tuple[Path, str | None]:
    name, sep, path = spec.partition("=")
    return (Path(path), name) if sep else (Path(spec), None)


def read(path: Path, name: str | None, loss_tag=None, grad_norm_tag=None):
    from protocol.curves import read_curve

    return read_curve(path, name=name, loss_tag=loss_tag, grad_norm_tag=grad_norm_tag)


def compare_plan(plan, out: Path | None, overrides: dict, loss_tag=None, grad_norm_tag=None, results=()) -> int:
    """The plan's runs compared; the report goes to `out`, by default the plan's output folder.

    `results` are those of `protocol run`: a run that failed or was skipped there is a FAILED or
    NOT RUN row, as is a run that has no metrics.jsonl. Every row is described from its run's
    own record.
    """
    from protocol.compare import compare, nothing_to_compare
    from protocol.plan_report import gather

    tolerance = replace(plan.tolerance, **overrides)
    problems = tolerance.problems()
    if problems:
        raise UsageError("; ".join(problems))
    found = gather(plan, results, lambda path, name: read(path, name, loss_tag, grad_norm_tag))
    where = "--out" if out else f"{plan.path}: plan.output"
    needed = 2 if tolerance.mode == "statistical" else 1
    if len(found.controls) < needed:
        note = found.control_note(needed)
        comparison = nothing_to_compare(plan.control.name, tolerance, found.not_compared, note)
        return report(comparison, [], [], out or plan.output, where, found)
    comparison = compare(found.controls, found.tests, tolerance, found.not_compared)
    return report(comparison, found.controls, found.tests, out or plan.output, where, found)


def report(comparison, controls, tests, out: Path, out_name: str, found) -> int:
    """Write the report of a plan's comparison, print the table and the verdict."""
    from protocol.report import format_table, write_report

    layouts = {run.name: run.layout for run in found.runs}
    paths = write_report(comparison, controls, tests, output_folder(out, out_name), layouts=layouts,
                         runs=found.runs, notes=found.notes)
    status = verdict(comparison, layouts, paths, format_table)
    if found.notes:  # the verdict is about what ran, which is not what the plan says now
        print(f"note: {len(found.notes)} run(s) differ from the plan as written now; the rows describe what they "
              "ran (`protocol run PLAN --rerun-stale` runs them again):")
        for name, differences in found.notes.items():
            print(f"  {name}: {'; '.join(differences)}")
    return status


def compare_and_report(controls, tests, tolerance: Tolerance, out: Path, out_name: str, layouts: dict) -> int:
    """Judge, write the report into `out` (named `out_name` in errors), print the table and the verdict."""
    from protocol.compare import compare
    from protocol.report import format_table, write_report

    comparison = compare(controls, tests, tolerance)
    paths = write_report(comparison, controls, tests, output_folder(out, out_name), layouts=layouts)
    return verdict(comparison, layouts, paths, format_table)


def verdict(comparison, layouts: dict, paths: dict, format_table) -> int:
    """Print the table, the files written and the verdict; the exit code (0 only when all pass)."""
    if comparison.note:
        print(f"FAIL: {comparison.note}")
    print(format_table(comparison, layouts))
    for path in paths.values():
        print(f"wrote {path}")
    failing = [r.name for r in comparison.results if not r.verdict] + [m.name for m in comparison.not_compared]
    print("PASS: every test set trains like the control" if comparison.passed else "FAIL: " + ", ".join(failing))
    return 0 if comparison.passed else 1


if __name__ == "__main__":
    sys.exit(main())
