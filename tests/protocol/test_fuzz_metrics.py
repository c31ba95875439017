"""metrics.jsonl and fingerprints.jsonl as the protocol reads them from run folders it did not
write (`protocol compare` takes any folder): hundreds of damaged versions of a genuine file, each
read (the damaged lines skipped where the reader skips them) or refused with one CurveError naming
the file and line; no other exception."""

from __future__ import annotations

import json
import random

import pytest

from protocol.plan.measure import read_records
from protocol.verdict.curves import CurveError, read_curve
from protocol.verdict.fingerprints import read_fingerprints
from tests.unit.test_fuzz_records import HOSTILE_TEXTS, HOSTILE_VALUES

CASES = 300


def genuine_lines() -> list[dict]:
    return [{"step": step, "loss": 5.0 - step / 10, "grad_norm": 1.5, "lr": 3e-4, "step_time_s": 0.1,
             "tokens_per_s": 1000.0, "memory": {"peak_rss_gib": 0.5}} for step in range(1, 6)]


def damaged(rng: random.Random) -> str:
    """A metrics.jsonl with one line replaced: a field set to a hostile value, the line cut, its
    bytes changed, or a hostile text."""
    lines = [json.dumps(line) for line in genuine_lines()]
    at = rng.randrange(len(lines))
    kind = rng.randrange(4)
    if kind == 0:
        record = genuine_lines()[at]
        record[rng.choice(list(record))] = rng.choice(HOSTILE_VALUES + [float("nan"), float("inf")])
        lines[at] = json.dumps(record)
    elif kind == 1:
        lines[at] = lines[at][:rng.randrange(len(lines[at]))]
    elif kind == 2:
        chars = list(lines[at])
        chars[rng.randrange(len(chars))] = chr(rng.randrange(32, 127))
        lines[at] = "".join(chars)
    else:
        lines[at] = rng.choice(HOSTILE_TEXTS)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", ["metrics.jsonl", "fingerprints.jsonl"])
def test_a_damaged_metrics_file_is_read_or_refused_by_line(tmp_path, name):
    rng = random.Random(name)
    refused = 0
    for i in range(CASES):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / name).write_text(damaged(rng), encoding="utf-8", errors="surrogatepass")
        if name == "fingerprints.jsonl":
            prints = read_fingerprints(folder)
            assert prints is not None and all(type(step) is int for step in prints)
            continue
        assert all(type(step) is int for step in read_records(folder).train_loss)
        try:
            read_curve(folder)
        except CurveError as e:
            assert f"{folder / name}:" in str(e), e
            refused += 1
    if name == "metrics.jsonl":
        assert refused > CASES // 4, f"only {refused} of {CASES} damaged files were refused"


def test_the_genuine_file_reads_whole(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in genuine_lines()) + "\n")
    curve = read_curve(tmp_path)
    assert read_records(tmp_path).train_loss == {step: 5.0 - step / 10 for step in range(1, 6)}
    assert len(curve.loss) == 5
