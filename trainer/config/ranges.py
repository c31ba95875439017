"""What each numeric key accepts, declared beside the key and checked in one place.

A key of the schema declares its valid values in its field's metadata:

    lr: float = valid(8e-4, gt=0)

The loader (trainer.config.checks.validate) refuses every value outside, naming the key, the
value and what is valid; `--help` and docs/configuration.md show the same text. Besides the
declared range, every float must be finite (nan fails every comparison, so `max_norm = nan`
would silently turn clipping off, and `lr = inf` trains to non-finite weights) and every int must
fit in 64 bits (they end up in tensors, seeds and checkpoint records).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The largest value a key that reaches torch as a float32 scalar may take (float32's largest is
# 3.4028e38): torch refuses a larger Python float in AdamW's step ("value cannot be converted to
# type float without overflow"), at the first step, long after the config was accepted.
FLOAT32_LARGEST = 3.4e38
# Seeds reach numpy's generators, which take non-negative seeds, and are mixed into 64-bit keys.
SEED_MAX = 2**32 - 1

# The dtype names a key may take (mixed_precision_reduce, export_dtype).
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class Valid:
    """The values a numeric key accepts: bounds (ge, gt, le, lt; None: unbounded), values valid
    besides them with what they mean (`also`: ((-1, "the newest"),); None: what leaving an
    optional key unset means), or a power of two. `note` says what the values mean; it follows
    the bounds in messages. `float32`: torch takes the value as a float32 scalar, so it is at
    most FLOAT32_LARGEST (an upper bound of its own when the key declares none)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[tuple[Any, str], ...] = ()
    power_of_two: bool = False
    note: str = ""
    float32: bool = False

    def __post_init__(self):
        if self.float32 and self.le is None and self.lt is None:
            object.__setattr__(self, "le", FLOAT32_LARGEST)

    def admits(self, value) -> bool:
        if any(value == special for special, _ in self.also):
            return True
        if self.power_of_two and not (value > 0 and math.frexp(value)[0] == 0.5):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def bounds(self) -> str:
        """The range alone: "> 0", "in [0, 1)", "a power of two", "" when unbounded."""
        if self.power_of_two:
            return "a power of two"
        low, high = (self.ge, "[") if self.ge is not None else (self.gt, "(")
        top, close = (self.le, "]") if self.le is not None else (self.lt, ")")
        if low is not None and top is not None:
            return f"in {high}{low}, {top}{close}"
        if low is not None:
            return f"{'>=' if high == '[' else '>'} {low}"
        if top is not None:
            return f"{'<=' if close == ']' else '<'} {top}"
        return ""

    def text(self, short: bool = False) -> str:
        """What is valid, as messages say it (short: without the explanations, for the tables)."""
        text = self.bounds() or ("finite" if short else "a finite number")
        notes = ["torch takes it as a float32, whose largest value is 3.4e38"] if self.float32 else []
        notes += [self.note] if self.note else []
        if notes and not short:
            text += f" ({'; '.join(notes)})"
        for special, meaning in self.also:
            text += f" or {'unset' if special is None else special}" + ("" if short else f" ({meaning})")
        return text


def valid(default, **declared) -> Any:
    """A dataclass field with this default whose valid values are `Valid(**declared)`."""
    return dataclasses.field(default=default, metadata={"valid": Valid(**declared)})


def declared(cls: type, name: str) -> Valid | None:
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("valid")


@functools.lru_cache(maxsize=None)
def _numeric_fields(cls: type) -> tuple[tuple[str, type], ...]:
    """(name, int or float) of each numeric field of a dataclass; Optional unwrapped."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if tp in (int, float):
            out.append((name, tp))
    return tuple(out)


def shown(value: Any, limit: int = 80) -> str:
    """A value as a message quotes it, cut short: a wrong value may be a whole table or megabytes
    of text, and Python refuses to print an int of more than 4300 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {value.bit_length()} bits"
    text = str(value) if isinstance(value, (int, float)) else repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]} ...{text[-1]}"


def value_problem(key: str, value, kind: type, rule: Valid | None) -> str | None:
    """Why `value` is not valid for `key`, or None."""
    rule = rule or Valid()
    if kind is float and not math.isfinite(value):
        return f"{key}: must be {rule.text()}, got {value} (not a finite number)"
    if kind is int and not INT64_MIN <= value <= INT64_MAX:
        return f"{key}: must be {rule.text()} and fit in 64 bits, got {shown(value)}"
    if not rule.admits(value):
        return f"{key}: must be {rule.text()}, got {shown(value)}"
    return None


def section_problems(prefix: str, section) -> list[str]:
    """The numeric values of one section (or [[table]] entry) that their keys do not accept."""
    problems = []
    for name, kind in _numeric_fields(type(section)):
        value = getattr(section, name)
        if value is not None:
            problem = value_problem(f"{prefix}.{name}", value, kind, declared(type(section), name))
            if problem:
                problems.append(problem)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):  # a table inside the section (quantize.linear)
            problems += section_problems(f"{prefix}.{f.name}", value)
        if isinstance(value, list):
            for index, entry in enumerate(value):
                if dataclasses.is_dataclass(entry):
                    problems += section_problems(f"{prefix}.{f.name}[{index}]", entry)
    return problems


def range_problems(config) -> list[str]:
    """Every numeric value of a JobConfig its key does not accept, one line each."""
    return [problem for f in dataclasses.fields(config)
            for problem in section_problems(f.name, getattr(config, f.name))]
