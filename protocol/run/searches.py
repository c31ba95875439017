"""Running a searched sweep (`search = "bisect"`): the points the bisection of protocol.plan.search
needs, one at a time, after the plan's other runs, each judged by the criterion as soon as it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protocol.plan.judging import control_value, family_noise, judge_run, threshold
from protocol.plan.model import Launch, Plan
from protocol.plan.search import bisect, outcome
from protocol.plan.sweeps import Sweep
from protocol.run.outcome import Progress, RunResult

RunPoint = Callable[[Launch], RunResult]


def run_searches(plan: Plan, selected: Sequence[Launch], run_point: RunPoint, report: Progress) -> dict[str, RunResult]:
    """Bisect every searched sweep over its selected points, running each point it needs with
    `run_point`; a RunResult for every point (those not needed: "not needed")."""
    by_name = {launch.name: launch for launch in selected}
    results: dict[str, RunResult] = {}
    for sweep in plan.sweeps:
        points = [by_name[name] for name in sweep.points if name in by_name]
        if sweep.search and points:
            results.update(run_search(plan, sweep, points, run_point, report))
    return results


def run_search(plan: Plan, sweep: Sweep, points: list[Launch], run_point: RunPoint,
               report: Progress) -> dict[str, RunResult]:
    control = control_value(plan)
    noise = family_noise(plan) if plan.criterion.in_sigmas else None
    bound = threshold(plan, control, noise)
    if bound.value is None:
        why = f"the search of sweep {sweep.name!r} cannot judge a point: {bound.missing}"
        report(why)
        return {launch.name: RunResult(launch.name, "skipped", message=why) for launch in points}
    report(f"search {sweep.name!r}: bisecting {len(points)} points for the last one meeting the criterion: "
           f"{plan.criterion.describe(control.value, noise.sigma if noise else None)}")
    results: dict[str, RunResult] = {}

    def meets(i: int) -> bool | None:
        launch = points[i]
        result = results[launch.name] = run_point(launch)
        if result.failed:
            return None
        judged = judge_run(plan, launch, bound)
        report(f"search {sweep.name!r}: {launch.name}: {judged.describe(plan.criterion)}")
        return judged.meets

    searched = Sweep(sweep.name, sweep.where, tuple(launch.name for launch in points), sweep.search)
    found = outcome(searched, *bisect(len(points), meets))
    report(found.describe())
    for name in found.unvisited():
        results[name] = RunResult(name, "not needed", message=f"not needed by the search of sweep {sweep.name!r}") \
            if found.complete else RunResult(name, "skipped", message=f"the search of sweep {sweep.name!r} stopped at "
                                                                      f"{found.blocked}, which could not be judged")
    return results
