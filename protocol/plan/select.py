"""Choosing among a plan's launches by name (`--only`): the runs named, and what they need."""

from __future__ import annotations

from collections.abc import Sequence

from protocol.plan.model import Launch


class LaunchError(ValueError):
    """A request that cannot be carried out as asked (unknown run name, a foreign folder in the
    way, stale runs without --rerun-stale)."""


def select(launches: Sequence[Launch], only: Sequence[str] | None) -> list[Launch]:
    """The launches named in `only` (names or their slugs) plus what they depend on, in plan order."""
    if not only:
        return list(launches)
    by_key = {}
    for launch in launches:
        by_key[launch.name] = by_key[launch.slug] = launch
    unknown = [name for name in only if name not in by_key]
    if unknown:
        valid = ", ".join(repr(launch.name) for launch in launches)
        raise LaunchError(f"unknown run name(s) {', '.join(map(repr, unknown))}; the plan's runs are: {valid}")
    chosen = {by_key[name].name for name in only}
    for launch in launches:
        if launch.name in chosen:
            chosen.update(launch.depends_on)  # a needed seed run is reused anyway when current
    return [launch for launch in launches if launch.name in chosen]
