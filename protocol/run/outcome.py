"""What each launch of `protocol run` came to (RunResult), and the summary printed at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    """What happened to one launch.

    status: "completed" (ran now and left a reusable run), "already complete" (reused),
    "failed" (see returncode, message, details, log), "skipped" (not run because a run it needs
    failed), "stopped" (an early-stop rule ended it, now or before; message: the rule and the
    value that broke it) or "not needed" (a point of a searched sweep the search did not need).
    message: why it failed, was skipped or stopped, one line; details: the log's error block or
    last lines.
    """

    name: str
    status: str
    returncode: int | None = None
    seconds: float = 0.0
    log: Path | None = None
    message: str = ""
    details: str = ""
    job_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("completed", "already complete")

    @property
    def failed(self) -> bool:
        """It failed, or was skipped because a run it needed did; a stopped run and a search point
        that was not needed are neither: the plan decided not to finish or run them."""
        return self.status in ("failed", "skipped")


def summarize(results: Sequence[RunResult], report: Progress) -> None:
    """The end of a run: every run complete, or each one that is not with why and where its log is
    (stopped runs with their rule, and how many search points were not needed)."""
    unneeded = [r for r in results if r.status == "not needed"]
    stopped = [r for r in results if r.status == "stopped"]
    bad = [r for r in results if r.failed]
    for r in stopped:
        report(f"{r.name}: STOPPED ({r.message})")
    if unneeded:
        report(f"not needed by the search: {', '.join(r.name for r in unneeded)}")
    if not bad:
        done = len(results) - len(unneeded) - len(stopped)
        report(f"all {done} runs complete" if not stopped else f"{done} runs complete, {len(stopped)} stopped")
        return
    for r in bad:
        why = f" ({r.message})" if r.message else ""
        error = next((line for line in r.details.splitlines() if line.startswith("error: ")), None)
        where = f", log: {r.log}" if r.log else ""
        report(f"{r.name}: {r.status.upper()}{why}{where}" + (f"\n    {error}" if error else ""))
