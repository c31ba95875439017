"""Reading the trainer's JSON records (checkpoint.json, lineage.json, run_meta.json) from folders
that may have been copied, edited or damaged since: a record is read whole and its fields are
checked for the types the trainer relies on, so that a bad one is refused with one message
naming the file and the field (RecordError), never a KeyError or TypeError deep in the code that
uses it. Torch-free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# Nothing this trainer writes is nested deeper; deeper input is refused before Python's parser
# recurses on it.
MAX_DEPTH = 64
MAX_BYTES = 64 * 2**20


class RecordError(ValueError):
    """A record file that cannot be what this trainer wrote; the message names it and why."""


def read_object(path: Path) -> dict | None:
    """The JSON object in `path`, or None when there is no such file; RecordError when it cannot
    be read or is not a JSON object."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RecordError(f"{path}: cannot be read ({e.strerror})") from None
    if len(data) > MAX_BYTES:
        raise RecordError(f"{path}: larger than {MAX_BYTES} bytes; not a record this trainer wrote")
    try:
        text = data.decode("utf-8")
        if nesting(text) > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        value = json.loads(text, parse_constant=refuse_constant)
    except ValueError as e:  # UnicodeDecodeError and json's errors are ValueErrors
        raise RecordError(f"{path}: is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def nesting(text: str) -> int:
    """An upper bound of the nesting depth of JSON `text` (brackets inside strings count too)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class Fields:
    """Checks the fields of one record, naming the file and the field in the refusal."""

    def __init__(self, path: Path, record: dict, prefix: str = ""):
        self.path, self.record, self.prefix = Path(path), record, prefix

    def refuse(self, key: str, what: str) -> RecordError:
        return RecordError(f"{self.path}: {self.prefix}{key} {what}; the file was changed or damaged since this "
                           "trainer wrote it")

    def optional(self, key: str, kinds: tuple | type, what: str) -> None:
        if key in self.record and self.record[key] is not None:
            self.require(key, kinds, what)

    def require(self, key: str, kinds: tuple | type, what: str) -> None:
        value = self.record.get(key)
        if not is_kind(value, kinds):
            raise self.refuse(key, f"is {describe(value)}, expected {what}")

    def optional_list(self, key: str, kinds: tuple | type, what: str) -> None:
        value = self.record.get(key)
        if value is None:
            return
        if not isinstance(value, list) or not all(is_kind(item, kinds) for item in value):
            raise self.refuse(key, f"is {describe(value)}, expected a list of {what}")

    def nested(self, key: str) -> Fields | None:
        """The checker of a nested object (None when absent), after checking it is one."""
        self.optional(key, dict, "an object")
        value = self.record.get(key)
        return Fields(self.path, value, f"{self.prefix}{key}.") if isinstance(value, dict) else None


def is_kind(value, kinds: tuple | type) -> bool:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds:  # True is an int to Python, not to a record
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, kinds)


def describe(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def check_ancestors(fields: Fields, key: str = "ancestors") -> None:
    """A lineage's ancestors: a list of {"lineage": str, "until_step": int}."""
    ancestors = fields.record.get(key)
    if ancestors is None:
        return
    if not isinstance(ancestors, list):
        raise fields.refuse(key, f"is {describe(ancestors)}, expected a list")
    for i, ancestor in enumerate(ancestors):
        if not isinstance(ancestor, dict):
            raise fields.refuse(f"{key}[{i}]", f"is {describe(ancestor)}, expected an object")
        item = Fields(fields.path, ancestor, f"{fields.prefix}{key}[{i}].")
        item.require("lineage", str, "a lineage id")
        item.require("until_step", int, "a step")


def check_checkpoint_record(path: Path, record: dict) -> dict:
    """checkpoint.json (trainer/checkpoint/step_folder.py: checkpoint_record): the fields the trainer reads."""
    fields = Fields(path, record)
    fields.require("step", int, "a step")
    if record["step"] < 0:
        raise fields.refuse("step", f"is {record['step']}, expected a step (0 or more)")
    fields.optional_list("items", str, "item names")
    fields.optional_list("exports", str, "export folder names")
    for key in ("kind", "lineage", "torch", "saved"):
        fields.optional(key, str, "a string")
    config = fields.nested("config")
    if config is not None:
        check_saved_config(config)
    fields.optional("code", dict, "the code version (an object)")
    parent = fields.nested("parent")
    if parent is not None:
        parent.optional("step", int, "a step")
        parent.optional("path", str, "a path")
    return record


def check_lineage_head(path: Path, record: dict) -> dict:
    """lineage.json (trainer/checkpoint/lineage.py: write_head)."""
    fields = Fields(path, record)
    fields.require("lineage", str, "a lineage id")
    fields.require("step", int, "a step")
    check_ancestors(fields)
    return record


def check_run_record(path: Path, record: dict) -> dict:
    """run_meta.json (trainer/records/run_meta.py), and each record in its history."""
    _check_start(Fields(path, record))
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise Fields(path, record).refuse("history", f"is {describe(history)}, expected a list")
        for i, earlier in enumerate(history):
            if not isinstance(earlier, dict):
                raise Fields(path, record).refuse(f"history[{i}]", f"is {describe(earlier)}, expected an object")
            _check_start(Fields(path, earlier, f"history[{i}]."))
    return record


def _check_start(fields: Fields) -> None:
    for key in ("status", "error", "started", "ended"):
        fields.optional(key, str, "a string")
    fields.optional("format", int, "a format number")
    fields.optional("last_step", int, "a step")
    fields.optional("metrics_from_step", int, "a step")
    fields.optional("config", dict, "the configuration (an object)")
    fields.optional("start", dict, "an object")
    trajectory = fields.nested("trajectory")
    if trajectory is not None:
        trajectory.require("lineage", str, "a lineage id")
        check_ancestors(trajectory)


# The keys of a saved configuration that a resume computes with (the schedule of the steps
# trained, the model variant): (types, smallest value). Other keys are only compared.
NUMBER = (int, float)
SAVED_CONFIG_KEYS = {
    "training": {"steps": (int, 1)},
    "lr_scheduler": {"warmup_steps": (int, 0), "decay_ratio": (NUMBER, 0), "decay_type": (str, None),
                     "min_lr_factor": (NUMBER, 0), "total_steps": (int, 1)},
    "parallelism": {"tensor_parallel_sync": (str, None), "tensor_parallel_degree": (int, 1),
                    "tensor_parallel_sync_group": (int, 0)},
}
COMPARED_SECTIONS = ("optimizer", "model", "quantize")  # named on resume when they differ (trainer.optim)


def check_saved_config(config: Fields) -> None:
    """The sections of a checkpoint's saved configuration that a resume reads: objects, and the
    keys it computes with of the type and range the trainer writes (None stands for unset)."""
    for section in COMPARED_SECTIONS:
        config.optional(section, dict, "an object")
    for section, keys in SAVED_CONFIG_KEYS.items():
        values = config.nested(section)
        if values is None:
            continue
        for key, (kinds, least) in keys.items():
            values.optional(key, kinds, "a number" if kinds in (int, NUMBER) else "a string")
            value = values.record.get(key)
            if least is not None and value is not None and value < least:
                raise values.refuse(key, f"is {value}, expected {least} or more")
