"""Hostile inputs for the fuzz tests (tests/*/test_fuzz_*.py), and the contract they check.

Every file the trainer reads from a folder it did not write (a tokenizer, a Hugging Face folder,
prepared shards, a plan, a job config) may hold anything. The fuzz tests start from a genuine
file and derive hundreds of variants from a seeded random.Random, so every run tries the same
cases:

- byte mutations (`mutate_bytes`): flipped bytes, a cut, inserted or random bytes, a range
  duplicated or removed, syntax characters and very deep nesting spliced in;
- structural mutations (`mutate_tree`, `dump`): the file parses, but a value has the wrong type,
  is huge, negative, nan or infinite, nested 100,000 deep, 100 kB long, holds control characters
  or a path out of the folder; keys are removed, renamed or unknown.

The contract (`check`): the loader returns a valid object, or raises the one error type its kind
documents, whose message names the file (or key), one line unless the kind lists problems;
any other exception fails the case. `files_opened` records the files the Python code opens, so
a test can also check that nothing outside the folder was read.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import traceback

import tomli_w

DEEP = 100_000  # nesting beyond any recursion limit
LONG = "x" * 100_000  # longer than any line a message may quote; TOML writes and reads 100 kB in ~15 ms
MESSAGE_LIMIT = 2_000  # an error message quotes what is wrong, not the whole of it

# Values a field may be given instead of the right one (both JSON and TOML can hold all but None;
# "__DEEP__" and "__HUGE__" are placeholders `dump` replaces).
HOSTILE = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 2**64 + 1, 10**40, "__HUGE__",
    1e308, -1e308, 1e39, 3.5e38, 5e-324, -0.0, math.nan, math.inf, -math.inf,
    "", " ", LONG, "\x00", "\x1b[31m\r\n", "\u2028", "\ud800", "²", "１２", "9" * 5000, "1e5", "true", "null",
    "../../etc/hostname", "/etc/hostname", "..", ".", "a/b", "C:\\x", "<|end_of_text|>",
    [], {}, [None, 1, "a"], {"": 1}, {"a": {"b": [{}]}}, list(range(2000)), "__DEEP__",
]
# The ones parsers and messages most often get wrong: drawn a quarter of the time.
SEVERE = ["__DEEP__", "__HUGE__", LONG, "\ud800", "\x00\n", "../../etc/hostname", "/etc/hostname", math.nan, 2**64]
# Placeholders `dump` writes as text no serializer would: nesting deeper than any recursion
# limit, and an integer of more digits than Python converts from text (4300).
DEEP_TEXT = "[" * DEEP + "]" * DEEP
HUGE_TEXT = "1" + "0" * 5000

# Syntax pieces spliced into a file: what its parser treats specially.
SPLICES = [b"\x00", b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b'"', b"{", b"}", b"[", b"]", b",", b":", b"\n",
           b"=", b"-1", b"1e999", b"NaN", b"Infinity", b"null", b"\\u0000", b"\\ud800", b"[[", b"'''", b'"""']


def mutate_bytes(data: bytes, rng: random.Random, span: tuple[int, int] | None = None) -> tuple[str, bytes]:
    """(what was done, the mutated bytes). `span` (start, stop): where positions are chosen
    (e.g. a safetensors header), the whole file by default."""
    start, stop = span or (0, len(data))
    at = rng.randint(start, max(start, stop))
    kind = rng.choice(["flip", "flip", "cut", "insert", "duplicate", "delete", "random", "splice", "splice",
                       "nest", "fill"])
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if start < stop:
                out[rng.randrange(start, stop)] ^= rng.randint(1, 255)
        return f"flip near byte {at}", bytes(out)
    if kind == "cut":
        return f"cut at byte {at}", data[:at]
    if kind == "insert":
        return f"insert at byte {at}", data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
    if kind == "duplicate":
        end = rng.randint(at, min(len(data), at + 256))
        where = rng.randint(0, len(data))
        return f"duplicate {at}:{end} at {where}", data[:where] + data[at:end] + data[where:]
    if kind == "delete":
        end = rng.randint(at, min(len(data), at + 64))
        return f"delete {at}:{end}", data[:at] + data[end:]
    if kind == "random":
        return "random bytes", rng.randbytes(rng.randint(0, 2 * len(data) + 16))
    if kind == "splice":
        piece = rng.choice(SPLICES)
        return f"splice {piece!r} at {at}", data[:at] + piece + data[at:]
    if kind == "nest":
        piece = rng.choice([b"[", b"{\"a\":", b"a=["])
        return f"nest {piece!r} at {at}", data[:at] + piece * DEEP + data[at:]
    end = rng.randint(at, min(len(data), at + 64))
    fill = rng.choice([b"\x00", b"\xff", b" "])
    return f"fill {at}:{end} with {fill!r}", data[:at] + fill * (end - at) + data[end:]


def _places(tree, path=()) -> list[tuple]:
    """The path of every value in a tree of dicts and lists (the root excluded)."""
    found = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for key, value in items:
        found.append((*path, key))
        found += _places(value, (*path, key))
    return found


def _parent(tree, path):
    for key in path[:-1]:
        tree = tree[key]
    return tree


def hostile_value(rng: random.Random):
    """One of HOSTILE, or a quarter of the time of SEVERE."""
    return copy.deepcopy(rng.choice(SEVERE if rng.random() < 0.25 else HOSTILE))


def mutate_tree(tree, rng: random.Random, toml: bool = False) -> tuple[str, object]:
    """(what was done, a mutated deep copy of a parsed JSON/TOML document). A value, a key or the
    shape of a table changes at a random place (TOML keeps to what TOML can hold: no null)."""
    tree = copy.deepcopy(tree)
    places = _places(tree)
    value = hostile_value(rng)
    while toml and _holds_none(value):
        value = hostile_value(rng)
    if not places:
        return f"the document replaced by {_short(value)}", {"a": value} if toml else value
    path = rng.choice(places)
    parent, key = _parent(tree, path), path[-1]
    kind = rng.choice(["value", "value", "value", "delete", "rename", "unknown", "wrap", "empty"])
    if kind == "delete":
        del parent[key]
    elif kind == "rename" and isinstance(parent, dict):
        parent[str(key) + rng.choice(["_", "\x00", " ", "\u00e9"])] = parent.pop(key)
    elif kind == "unknown" and isinstance(parent, dict):
        parent[rng.choice(["unknown", "", "\x1b", "__proto__", "a.b"])] = value
    elif kind == "wrap":
        parent[key] = [parent[key]] if rng.random() < 0.5 else {"value": parent[key]}
    elif kind == "empty":
        parent[key] = type(parent[key])() if isinstance(parent[key], (dict, list, str)) else ("" if toml else None)
    else:
        kind = "value"
        parent[key] = value
    return f"{kind} at {'/'.join(map(str, path))}: {_short(value)}", tree


def _holds_none(value) -> bool:
    if isinstance(value, (list, dict)):
        return any(_holds_none(v) for v in (value.values() if isinstance(value, dict) else value))
    return value is None


def dump(tree, toml: bool = False) -> bytes:
    """A parsed document written back: JSON or TOML, with "__DEEP__" replaced by deep nesting and
    lone surrogates kept as the (invalid) UTF-8 bytes they would be."""
    if toml:
        text = tomli_w.dumps(tree if isinstance(tree, dict) else {"a": tree})
    else:
        text = json.dumps(tree, allow_nan=True)
    text = text.replace('"__DEEP__"', DEEP_TEXT).replace('"__HUGE__"', HUGE_TEXT)
    return text.encode("utf-8", "surrogatepass")


def _short(value) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**50 else f"int of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:55] + "..."


def check(case: str, load, error: type, names, valid=None, one_line: bool = True) -> str:
    """One case of the contract: "loaded" (valid(result) holds) or "refused" (`error` whose
    message names one of `names`, on one line, or short lines where the kind lists problems).
    Any other exception is the failure the fuzzing looks for."""
    names = [str(n) for n in ([names] if isinstance(names, (str, os.PathLike)) else names)]
    message = None
    try:
        result = load()
    except error as e:
        message = str(e)
    except Exception as e:  # noqa: BLE001 - any other type breaks the contract
        where = "".join(traceback.format_tb(e.__traceback__)[-4:])  # the exception itself may be a megabyte
        raise AssertionError(f"{case}: {type(e).__name__} escaped instead of {error.__name__}: {str(e)[:500]}\n"
                             f"{where}") from None
    if message is None:
        if valid is not None:
            valid(result)
        return "loaded"
    # Checked outside the except clause, so that a failure does not print the exception whole.
    lines = message.splitlines() or [""]
    assert any(name in message for name in names), f"{case}: the message names none of {names}: {message[:500]}"
    assert not (one_line and len(lines) > 1), f"{case}: not one line: {message[:500]}"
    assert max(map(len, lines)) < MESSAGE_LIMIT, f"{case}: a line of {max(map(len, lines))} characters: {message[:500]}"
    return "refused"


_watching: list[list[str]] = []
_hooked = False


def _hook(event: str, args: tuple) -> None:
    if _watching and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        try:  # never in the way of the code under test
            _watching[-1].append(os.fsdecode(args[0]))
        except Exception:  # noqa: BLE001
            pass


@contextlib.contextmanager
def files_opened():
    """The paths the Python code opens inside the block (an audit hook: files a C or Rust
    library opens itself are not seen)."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_hook)
        _hooked = True
    opened: list[str] = []
    _watching.append(opened)
    try:
        yield opened
    finally:
        _watching.pop()


def outside(opened: list[str], *forbidden) -> list[str]:
    """The opened paths that lie in (or are) one of the forbidden paths, links resolved."""
    roots = [os.path.realpath(f) for f in forbidden]
    real = {p: os.path.realpath(p) for p in opened}
    return [p for p in opened if any(real[p] == r or real[p].startswith(r + os.sep) for r in roots)]
