"""The trainer's JSON records as someone else's files: checkpoint.json, lineage.json and
run_meta.json in a folder copied, edited or damaged since the trainer wrote them. Hundreds of
generated hostile versions of each genuine record are driven through every function that reads
it; each must give an answer or refuse with one RecordError (or the preflight's ConfigError)
naming the file: no KeyError, TypeError, OverflowError or RecursionError from deep inside."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainer.records import run_meta
from trainer.checkpoint.on_disk import is_full_checkpoint, missing_exports, read_checkpoint_record
from trainer.checkpoint.lineage import foreign_checkpoint, forked_ancestors, lineage_of, model_change, read_head
from trainer.config.manager import ConfigError, load_config, to_dict
from trainer.records.untrusted_json import RecordError
from trainer.optim import schedule_change, settings_changed
from trainer.preflight.resume import check_resume

CASES = 300
HOSTILE_VALUES = [None, True, False, 0, -1, -(2**70), 2**70, 1e308, -1e308, 0.5, "", "x" * 5000, "step-3",
                  "../../../etc/passwd", "\x00\n", [], [1, "a", None], {}, {"a": {"b": []}}, [[[[[]]]]]]
# Text that is not JSON as the trainer writes it, or that a careless json.loads would accept.
HOSTILE_TEXTS = ["", "{", "null", "[]", "3", '"text"', "NaN", '{"step": NaN}', '{"step": Infinity}',
                 "[" * 100000 + "]" * 100000, "\ufeff{}", b"\xff\xfe{\x00}".decode("latin-1"), '{"step": 1} trailing']


def config(tmp_path: Path):
    return load_config(["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "--training.steps", "8",
                        "--checkpoint.last_save_model_only"])


def genuine(tmp_path: Path) -> dict:
    """A run folder as the trainer leaves it after saving step 4: the three records."""
    cfg = config(tmp_path)
    saved = to_dict(cfg)
    checkpoint = {"step": 4, "items": ["model", "optimizer", "lr_scheduler", "dataloader", "train_state"],
                  "kind": "periodic", "exports": [], "lineage": "aaaa", "config": saved,
                  "parent": {"step": 2, "path": "/somewhere/step-2", "fingerprint": "0123"},
                  "code": {"commit": "abc", "dirty": False}, "torch": "2.13.0", "saved": "2026-01-01T00:00:00+00:00"}
    head = {"lineage": "aaaa", "step": 4, "ancestors": [{"lineage": "bbbb", "until_step": 2}]}
    record = {"format": 2, "status": "running", "started": "t", "ended": None, "last_step": 4, "config": saved,
              "start": {"kind": "resume", "path": "/x", "step": 2, "fingerprint": None},
              "trajectory": {"lineage": "aaaa", "ancestors": [{"lineage": "bbbb", "until_step": 2}]},
              "history": [{"format": 2, "status": "running", "last_step": 2, "trajectory": {"lineage": "bbbb"}}]}
    return {"checkpoint.json": checkpoint, "lineage.json": head, "run_meta.json": record}


def mutations(document, rng: random.Random):
    """Hostile versions of a JSON document: a value replaced, a key removed or renamed, a
    container replaced by another kind, text cut or bytes changed, or a whole hostile text."""
    for _ in range(CASES):
        kind = rng.randrange(5)
        if kind == 0:
            yield json.dumps(replace_somewhere(document, rng, rng.choice(HOSTILE_VALUES)))
        elif kind == 1:
            yield json.dumps(replace_somewhere(document, rng, REMOVE))
        elif kind == 2:
            text = json.dumps(document)
            yield text[:rng.randrange(len(text))]
        elif kind == 3:
            text = bytearray(json.dumps(document).encode())
            for _ in range(rng.randint(1, 4)):
                text[rng.randrange(len(text))] = rng.randrange(256)
            yield bytes(text)
        else:
            yield rng.choice(HOSTILE_TEXTS)


REMOVE = object()


def replace_somewhere(document, rng: random.Random, value):
    """A deep copy of `document` with one value anywhere in it (at a random depth) replaced or removed."""
    copy = json.loads(json.dumps(document))
    parent, key = copy, None
    while True:
        children = list(parent.items()) if isinstance(parent, dict) else list(enumerate(parent))
        if not children:
            break
        key, child = rng.choice(children)
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.4:
            break
        parent = child
    if key is None:
        return value if value is not REMOVE else {}
    if value is REMOVE:
        del parent[key]
    else:
        parent[key] = value
    return copy


def write(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")


def lay_out(tmp_path: Path, records: dict, name: str, content) -> tuple:
    """The run folder with its three genuine records, one of them replaced by `content`."""
    cfg = config(tmp_path)
    run = Path(cfg.job.dump_folder)
    checkpoints = run / "checkpoint"
    step = checkpoints / "step-4"
    step.mkdir(parents=True, exist_ok=True)
    (step / ".metadata").write_bytes(b"")
    places = {"checkpoint.json": step / "checkpoint.json", "lineage.json": checkpoints / "lineage.json",
              "run_meta.json": run / "run_meta.json"}
    for record, place in places.items():
        write(place, json.dumps(records[record]))
    write(places[name], content)
    return cfg, run, step, places[name]


def read_everything(cfg, run: Path, step: Path) -> None:
    """Every reader of the records, as the preflight and the ranks call them on a resume."""
    record = read_checkpoint_record(step)
    is_full_checkpoint(step)
    missing_exports(step, cfg)
    lineage_of(step)
    model_change(step, to_dict(cfg)["parallelism"])
    foreign_checkpoint(step.parent, step)
    forked_ancestors(read_head(step.parent), step, 4)
    if record is not None and "config" in record:
        settings_changed(record["config"], cfg)
        schedule_change(record["config"], cfg, 4)
    earlier = run_meta.load_record(run)
    run_meta.continues(earlier, 4, {"lineage": "aaaa", "ancestors": []})
    if earlier is not None:
        run_meta.on_trajectory(earlier, 4, {"lineage": "aaaa", "ancestors": []})
    run_meta.complete_after_final_save(run, 8)
    run_meta.begin(run, {"config": {}}, 4, {"lineage": "aaaa", "ancestors": []})


@pytest.mark.parametrize("name", ["checkpoint.json", "lineage.json", "run_meta.json"])
def test_a_damaged_record_is_read_or_refused_naming_it(tmp_path, name):
    records = genuine(tmp_path)
    refused = 0
    for i, content in enumerate(mutations(records[name], random.Random(name))):
        cfg, run, step, place = lay_out(tmp_path / str(i), records, name, content)
        try:
            check_resume(cfg)
        except ConfigError as e:
            assert str(place) in str(e), (content, e)
        try:
            read_everything(cfg, run, step)
        except RecordError as e:
            assert str(place) in str(e) and "\n" not in str(e).strip(), (content, e)
            refused += 1
    assert refused > CASES // 3, f"only {refused} of {CASES} hostile versions of {name} were refused"


def test_the_genuine_records_are_read_whole(tmp_path):
    records = genuine(tmp_path)
    cfg, run, step, _ = lay_out(tmp_path, records, "run_meta.json", json.dumps(records["run_meta.json"]))
    check_resume(cfg)
    assert read_checkpoint_record(step) == records["checkpoint.json"]
    assert read_head(step.parent) == records["lineage.json"]
    assert run_meta.load_record(run) == records["run_meta.json"]
    read_everything(cfg, run, step)


def test_the_protocol_reads_a_damaged_run_record_as_none(tmp_path):
    (tmp_path / "run_meta.json").write_text('{"status": 3}')
    assert run_meta.read_record(tmp_path) is None
    with pytest.raises(RecordError, match=r"run_meta.json: status is 3 \(int\), expected a string"):
        run_meta.load_record(tmp_path)


@pytest.mark.parametrize("text, message", [
    ('{"step": "4"}', r"checkpoint.json: step is \"4\" \(str\), expected a step"),
    ('{"step": 4, "items": "model"}', r"items is \"model\" \(str\), expected a list of item names"),
    ('{"step": 4, "step": NaN}', "NaN is not a JSON number"),
    ('{"step": 4, "config": {"lr_scheduler": {"warmup_steps": -5}}}', r"config.lr_scheduler.warmup_steps is -5"),
    ('{"step": 4, "config": {"parallelism": []}}', r"config.parallelism is \[\] \(list\), expected an object"),
    ("[" * 1000 + "]" * 1000, "nested deeper than 64"),
])
def test_a_refusal_says_what_is_wrong_with_the_field(tmp_path, text, message):
    (tmp_path / "checkpoint.json").write_text(text)
    with pytest.raises(RecordError, match=message):
        read_checkpoint_record(tmp_path)
