"""Running a plan's launches on this node, one after another, through torchrun_launch.sh.

Each run's output is appended to `<output>/<run>/protocol.log` under a header line, so earlier
attempts stay readable. A failed run is reported with the launcher's error block (or the last
lines of its log) and the others still run, except those that need a seed checkpoint that
failed.

Every progress line of a running run says about how long it and the plan have left: the run's
from its steps done and the time they took, the plan's from the launches this invocation ran
(TimeLeft). While a test set runs, the plan's early-stop rules are checked at every progress
poll: a run that breaks one is ended as an interrupt would end it (protocol.run.folders marks its
folder) and the others go on. The points of searched sweeps run last, as the search needs them
(protocol.run.searches).

What to do with each launch (reuse, run, leave stopped, or refuse) is decided once, before the
first starts (protocol.run.prepare); this module carries it out.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from protocol.plan.early_stop import Breach, applies, breach
from protocol.plan.model import REPO_ROOT, Launch, Plan
from protocol.plan.select import LaunchError, select
from protocol.run.failures import exit_problem, indent, summary
from protocol.run.folders import claim_folder, clear_stopped, mark_stopped, now
from protocol.run.outcome import Progress, RunResult, summarize
from protocol.run.prepare import prepare, resume_note, settled
from protocol.run.reuse import RUN, Decision, completion_problem
from protocol.run.searches import run_searches

logger = logging.getLogger(__name__)

LAUNCHER = REPO_ROOT / "torchrun_launch.sh"
LOG_NAME = "protocol.log"
METRICS_FILE = "metrics.jsonl"


def run_local(plan: Plan, launches: Sequence[Launch], only: Sequence[str] | None = None,
              on_progress: Progress | None = None, launcher: Sequence[str] | None = None,
              progress_interval: float = 60.0, rerun_stale: bool = False) -> list[RunResult]:
    """Run the launches on this node, one after another; return one RunResult per selected launch.

    Current finished runs are reused; stale ones are refused (LaunchError), or with rerun_stale
    moved aside and run again. `launcher` replaces torchrun_launch.sh (tests use a fake);
    `progress_interval` is how often the step a running run reached is reported and the
    early-stop rules are checked. Without `only`, the points of searched sweeps run last, those
    the search needs; with it, the named runs run as they are.
    """
    report = on_progress or logger.info
    selected = select(launches, only)
    too_big = [f"{launch.name!r} ({launch.nodes} nodes)" for launch in selected if launch.nodes > 1]
    if too_big:
        raise LaunchError(f"runs needing several nodes cannot run locally: {', '.join(too_big)}; use the SLURM "
                          "launcher, or --only with single-node runs")
    decisions = prepare(plan, selected, rerun_stale, report)
    command = list(launcher) if launcher else [str(LAUNCHER)]
    searching = not only
    first = [launch for launch in selected if not (searching and launch.search)]
    results: dict[str, RunResult] = {}
    failed: set[str] = set()
    # Seed jobs are short and unlike a training run: the plan's estimate counts training runs.
    timer = TimeLeft([launch.name for launch in first
                      if launch.role != "seed" and decisions[launch.name].action == RUN])

    def run(launch: Launch, head: str) -> RunResult:
        result = results[launch.name] = run_one(plan, decisions[launch.name], command, head, failed, report,
                                                progress_interval, timer)
        if result.failed:
            failed.add(launch.name)
        return result

    for i, launch in enumerate(first, 1):
        run(launch, f"[{i}/{len(first)}] {launch.name}")
    if searching:
        results.update(run_searches(plan, selected, lambda launch: run(launch, f"[search] {launch.name}"), report))
    ordered = [results[launch.name] for launch in selected]
    summarize(ordered, report)
    return ordered


def run_one(plan: Plan, decision: Decision, command: list[str], head: str, failed: set[str], report: Progress,
            progress_interval: float, timer: TimeLeft | None = None) -> RunResult:
    launch = decision.launch
    timer = timer or TimeLeft([])
    timer.reached(launch.name)
    blocked = [name for name in launch.depends_on if name in failed]
    if blocked:
        report(f"{head}: skipped, it needs {', '.join(blocked)}, which did not complete")
        return RunResult(launch.name, "skipped", message=f"needs {', '.join(blocked)}, which did not complete")
    log = launch.output / LOG_NAME
    done = settled(decision, head, report, log)
    if done is not None:
        return done
    claim_folder(plan, launch)
    clear_stopped(launch.output)  # stopped under rules the plan no longer has: it runs on
    again = f", {decision.reason}" if decision.reason.startswith("the previous") else ""
    again += resume_note(plan, decision)
    report(f"{head}: running {launch.nproc} process{'es' if launch.nproc > 1 else ''}{again} ... (log: {log})")
    timer.start(decision.resume_from or 0)
    returncode, seconds, start, broke = execute(plan, launch, command, head, report, progress_interval, timer)
    if launch.role != "seed" and broke is None and not returncode:
        timer.took.append(seconds)  # a whole run: what each of the plan's next ones will take
    if broke is not None:
        report(f"{head}: STOPPED after {seconds:.1f} s by {broke.describe()}")
        return RunResult(launch.name, "stopped", returncode, seconds, log, broke.describe())
    problem = exit_problem(returncode, launch) if returncode else completion_problem(plan, launch)
    if problem:
        title, text = summary(log, start)
        report(f"{head}: FAILED ({problem}), log: {log}, {title}:\n{indent(text)}")
        return RunResult(launch.name, "failed", returncode, seconds, log, problem, text)
    report(f"{head}: done in {seconds:.1f} s")
    return RunResult(launch.name, "completed", returncode, seconds, log)


def execute(plan: Plan, launch: Launch, command: list[str], head: str, report: Progress,
            progress_interval: float, timer: TimeLeft) -> tuple[int, float, int, Breach | None]:
    """Start the launcher, wait, report the step reached now and then; (exit code, seconds, offset
    of this attempt's output in the log, the early-stop rule it broke if it was stopped)."""
    env = dict(os.environ)
    # The interpreter running the protocol has the project and torch installed: the launcher uses
    # it unless the user chose one (without this it would look for an activated or ./.venv).
    env.setdefault("PYTHON", sys.executable)
    if launch.role != "seed":
        env["NGPU"] = str(launch.nproc)
    log = launch.output / LOG_NAME
    with open(log, "ab") as f:
        f.write(f"=== {now()}: {launch.command()}\n".encode())
        f.flush()
        start = f.tell()  # this attempt's output begins after its header line
        began = time.monotonic()
        proc = subprocess.Popen([*command, *launch.args], cwd=REPO_ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            returncode, broke = wait(proc, plan, launch, head, report, progress_interval, timer)
        except BaseException:
            stop(proc)
            raise
    return returncode, time.monotonic() - began, start, broke


def wait(proc: subprocess.Popen, plan: Plan, launch: Launch, head: str, report: Progress,
         interval: float, timer: TimeLeft) -> tuple[int, Breach | None]:
    """(exit code, None) once the run ends, or (exit code, the rule it broke) once it was stopped."""
    reported = 0
    rules = plan.early_stop if applies(launch) else ()
    while True:
        try:
            return proc.wait(timeout=interval), None
        except subprocess.TimeoutExpired:
            step = last_step(launch) if launch.role != "seed" else 0
            if step > reported:
                report(f"{head}: step {step}/{plan.steps}{timer.left(step, plan.steps)}")
                reported = step
            broke = breach(rules, launch.output)
            if broke is not None:
                # Marked before it is ended, so that an interrupt while it ends leaves the reason.
                mark_stopped(launch.output, broke)
                stop(proc)
                return proc.returncode, broke


class TimeLeft:
    """The time-left estimates of the progress lines.

    The running launch: its steps still to run at the pace it has shown, measured from its
    first progress line once there are two (its start-up then stays out of a per-step pace), from
    its start before that. The plan: that, plus each training launch still to run at the mean of
    those run to the end now (the running one's expected whole while none has); reused runs take
    nothing, and a searched sweep's points, which the search picks later, are not counted."""

    def __init__(self, to_run: Sequence[str], clock: Callable[[], float] = time.monotonic):
        self.to_run = list(to_run)
        """Training launches still to run after the running one, in order."""
        self.took: list[float] = []
        """Seconds of each training launch run to its end by this invocation."""
        self.clock = clock
        self.began = clock()
        self.from_step = 0
        self.first: tuple[float, int] | None = None

    def reached(self, name: str) -> None:
        """The launch `name` runs now or is passed over: it is no longer still to run."""
        if name in self.to_run:
            self.to_run.remove(name)

    def start(self, from_step: int = 0) -> None:
        """A launch starts now, at from_step (a resumed run's checkpoint, else 0)."""
        self.began, self.from_step, self.first = self.clock(), from_step, None

    def left(self, step: int, steps: int) -> str:
        """', about 2 min left in this run, about 14 min in the plan' ('' before a pace is known)."""
        now = self.clock()
        if self.first is None or step <= self.first[1]:
            seconds, done = now - self.began, step - self.from_step
            self.first = self.first or (now, step)
        else:
            seconds, done = now - self.first[0], step - self.first[1]
        if done <= 0:
            return ""
        run_left = max(0, steps - step) * seconds / done
        text = f", about {duration(run_left)} left in this run"
        if self.to_run:
            each = sum(self.took) / len(self.took) if self.took else now - self.began + run_left
            text += f", about {duration(run_left + each * len(self.to_run))} in the plan"
        return text


def duration(seconds: float) -> str:
    """'40 s', '14 min', '2.5 h': rounded as an estimate should be."""
    if seconds < 90:
        return f"{max(1, round(seconds / 10) * 10) if seconds >= 10 else max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def last_step(launch: Launch) -> int:
    """The highest training step in metrics.jsonl so far (0 when absent): progress only."""
    path = launch.output / METRICS_FILE
    step = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line being written
            if isinstance(record, dict) and "kind" not in record and isinstance(record.get("step"), int):
                step = max(step, record["step"])
    return step


def stop(proc: subprocess.Popen) -> None:
    """Interrupted (Ctrl-C) or stopped by a rule: end the child (the launcher ends its ranks on
    SIGTERM), and kill it if it has not ended after 30 seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
