"""Where the test suite's CPU goes: per test and per file, its own process and the warm Python's
forks it started, from a run's TEST_CPU_LOG.

    TEST_CPU_LOG=cpu.jsonl make test
    python benchmarks/suite_cpu.py cpu.jsonl [--top 30]

The log holds a line per test (tests/machine_share.py: its wall seconds, the CPU seconds of the
pytest worker running it and of the children it waited for, the machine's busy CPU seconds
meanwhile) and a line per fork of the warm Python (tests/warm_python/server.py: the CPU seconds of
the fork and of the children it waited for, and the test that started it). The forks are most of
the suite's work (the launchers and ranks of the tests' runs), and no test process can see them:
this adds the two. A module-scoped fixture's processes count for the test that set it up, and a
multiprocessing fork server (`code (python -c)`), which serves a process's later children, for
the test that started it; a fork whose environment was copied before its test began (a module's
constant) counts as "(outside any test)"; a test that runs pytest itself (the GPU suite's smoke
run) adds its inner tests' lines. What neither counts: the servers themselves, pytest's
collection, SLURM's daemons and the processes its jobs start outside the warm Python; the
machine's busy seconds (the run's last line) include them. A line that is not the log's (a run
killed mid-write, another file) is refused with its file and line number.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from common import table  # noqa: I001 (sets sys.path)


def read(path: str) -> tuple[dict[str, dict], list[dict]]:
    """The test lines by node id, and the fork lines."""
    tests, forks = {}, []
    with open(path) as log:
        for number, line in enumerate(log, 1):
            try:
                record = json.loads(line)
                if "fork" in record:
                    forks.append({"fork": str(record["fork"]), "test": str(record["test"]),
                                  "cpu": float(record["cpu"])})
                else:
                    tests[str(record["test"])] = {"wall": float(record["wall"]), "cpu": float(record["cpu"])}
            except (ValueError, TypeError, KeyError) as error:
                raise SystemExit(f"{path}:{number}: not a TEST_CPU_LOG line ({error!r}): {line[:200].rstrip()}")
    return tests, forks


def per_test(tests: dict[str, dict], forks: list[dict]) -> dict[str, dict]:
    """node id -> wall, own CPU, forks' CPU and count, their sum (a fork outside any test: '')."""
    totals = defaultdict(lambda: {"wall": 0.0, "own": 0.0, "forks": 0.0, "count": 0})
    for name, record in tests.items():
        totals[name].update(wall=record["wall"], own=record["cpu"])
    for fork in forks:
        totals[fork["test"]]["forks"] += fork["cpu"]
        totals[fork["test"]]["count"] += 1
    for entry in totals.values():
        entry["total"] = entry["own"] + entry["forks"]
    return dict(totals)


def by_file(totals: dict[str, dict]) -> Counter:
    files = Counter()
    for name, entry in totals.items():
        files[name.split("::")[0] or "(outside any test)"] += entry["total"]
    return files


def by_kind(forks: list[dict]) -> dict[str, tuple[float, int]]:
    """What the forks ran ('module trainer.train', 'script ...', 'code ...') -> CPU, count."""
    kinds = defaultdict(lambda: [0.0, 0])
    for fork in forks:
        how, _, what = fork["fork"].partition(" ")
        # A script by its file name (tests write theirs into their own folders); code by its form.
        kind = {"code": "code (python -c)", "script": f"script {Path(what).name}"}.get(how, fork["fork"])
        kinds[kind][0] += fork["cpu"]
        kinds[kind][1] += 1
    return {kind: (cpu, count) for kind, (cpu, count) in kinds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the TEST_CPU_LOG file of one run")
    parser.add_argument("--top", type=int, default=30, help="rows of each table (default 30)")
    args = parser.parse_args()
    tests, forks = read(args.log)
    totals = per_test(tests, forks)
    own, forked = sum(e["own"] for e in totals.values()), sum(e["forks"] for e in totals.values())
    print(f"{len(tests)} tests: {own:,.0f} CPU-seconds in the tests' processes, {forked:,.0f} in "
          f"{len(forks)} forks of the warm Python, {own + forked:,.0f} in all (the run's last line, the machine's busy "
          "CPU-seconds, also counts the servers, the collection and SLURM's daemons)\n")
    kinds = sorted(by_kind(forks).items(), key=lambda item: -item[1][0])[:args.top]
    print(table(["forks of", "CPU-s", "count", "CPU-s each"],
                [[kind, f"{cpu:,.1f}", count, f"{cpu / count:.2f}"] for kind, (cpu, count) in kinds]))
    print()
    print(table(["file", "CPU-s"], [[name, f"{cpu:,.1f}"] for name, cpu in by_file(totals).most_common(args.top)]))
    print()
    heaviest = sorted(totals.items(), key=lambda item: -item[1]["total"])[:args.top]
    print(table(["test", "CPU-s", "own", "forks", "forks (count)", "wall s"],
                [[name or "(outside any test)", f"{e['total']:,.1f}", f"{e['own']:.1f}", f"{e['forks']:.1f}",
                  e["count"], f"{e['wall']:.1f}"] for name, e in heaviest]))


if __name__ == "__main__":
    main()
