"""Searched sweeps (`search = "bisect"`): run only the points a bisection needs to find the last
point, in the written order, that meets the criterion.

A searched sweep's points are written from the most communication to the least (full sync, one
per block, groups of 2, 3, ...), and the search assumes that the points meeting the criterion
form a prefix of that order: less communication never helps. The bisection then keeps `lo`, the
last point known to meet it (-1 before any), and `hi`, the first known to miss it (the count
before any), runs the point midway and moves one end, until they are neighbours: the answer is
`lo`, after at most ceil(log2(count + 1)) runs. A stopped run (protocol.plan.early_stop) misses
the criterion; a run that fails, or that has no value of the measure, ends the search unanswered.

`protocol run` walks the bisection after the other runs, running each point it needs
(protocol.run.searches; the control's value is what a relative criterion multiplies); `protocol
compare` replays the same bisection on the judgements the run folders give (`replay`), so it
knows which points the search ran and which it did not need. The walk only depends on the
judgements, so a second `protocol run` walks the same points and reuses the runs it made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol.plan.judging import Judgement
from protocol.plan.sweeps import Sweep


@dataclass(frozen=True)
class SearchOutcome:
    """Which points a bisection judged, in the order it needed them, and what it found.

    answer: the last point meeting the criterion (None: none does, or the search did not end);
    blocked: the point it needed but could not judge, which ended it early.
    """

    sweep: Sweep
    visited: tuple[str, ...]
    answer: str | None
    blocked: str | None = None

    @property
    def complete(self) -> bool:
        return self.blocked is None

    def unvisited(self) -> list[str]:
        return [name for name in self.sweep.points if name not in self.visited]

    def describe(self) -> str:
        ran = ", ".join(self.visited) or "none"
        if not self.complete:
            return f"search {self.sweep.name!r} unfinished: {self.blocked} could not be judged (ran: {ran})"
        found = f"answer {self.answer}" if self.answer else "no point meets the criterion"
        return f"search {self.sweep.name!r}: {found} (ran: {ran}; not needed: {', '.join(self.unvisited()) or 'none'})"


def bisect(count: int, meets: Callable[[int], bool | None]) -> tuple[list[int], int | None, int | None]:
    """(indices judged in order, the last index meeting the criterion or None, the index that
    could not be judged or None), with the points meeting it assumed to be a prefix."""
    lo, hi = -1, count
    visited: list[int] = []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        visited.append(mid)
        verdict = meets(mid)
        if verdict is None:
            return visited, None, mid
        if verdict:
            lo = mid
        else:
            hi = mid
    return visited, (lo if lo >= 0 else None), None


def replay(sweep: Sweep, judgements: dict[str, Judgement]) -> SearchOutcome:
    """The bisection `protocol run` made (or would make next), from the runs' judgements."""
    def meets(i: int) -> bool | None:
        found = judgements.get(sweep.points[i])
        return None if found is None else found.meets

    visited, answer, blocked = bisect(len(sweep.points), meets)
    return outcome(sweep, visited, answer, blocked)


def outcome(sweep: Sweep, visited: list[int], answer: int | None, blocked: int | None) -> SearchOutcome:
    return SearchOutcome(sweep, tuple(sweep.points[i] for i in visited),
                         None if answer is None else sweep.points[answer],
                         None if blocked is None else sweep.points[blocked])
