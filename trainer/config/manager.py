"""Build a JobConfig from defaults, a TOML file and command-line overrides.

Precedence: command line > TOML > dataclass defaults. Every user mistake (unknown section or
key, wrong type, invalid value, missing file) raises ConfigError with one message that names
the key and where it came from, and says what would be valid.

Command-line syntax:
  --section.key value    --section.key=value
  --section.flag         --section.no_flag      --section.flag=false   (booleans)
  --section.items a,b,c                                                  (lists)
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from trainer.config.checks import validate
from trainer.config.errors import ConfigError
from trainer.config.torchtitan_keys import IGNORED_KEYS, IGNORED_SECTIONS, is_ignored
from trainer.config.job_config import JobConfig
from trainer.config.ranges import declared, shown
from trainer.config.torchtitan_keys import REFUSED
from trainer.messages import SHOWN

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

# Set by the launcher once it has warned about the ignored options of the config its ranks load.
IGNORED_SHOWN = "TRAINER_IGNORED_OPTIONS_SHOWN"

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS_DIR = REPO_ROOT / "train_configs"
DEFAULT_CONFIG_FILE = "debug_model.toml"  # what the entry points train without --job.config_file
BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


# ---------------------------------------------------------------------------------------------
# Introspection of the dataclasses


def sections() -> dict[str, type]:
    """Section name -> dataclass type, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.lru_cache(maxsize=None)
def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


@functools.lru_cache(maxsize=None)
def leaf_types(section_cls: type) -> dict[str, Any]:
    """Every key of a section with its type. A field that is itself a table (a dataclass, as
    quantize's linear.float8) gives its keys dotted: "linear.float8.recipe_name"."""
    leaves = {}
    for name, tp in field_types(section_cls).items():
        if dataclasses.is_dataclass(tp):
            leaves.update({f"{name}.{key}": inner for key, inner in leaf_types(tp).items()})
        else:
            leaves[name] = tp
    return leaves


def leaf_owner(section_cls: type, key: str) -> tuple[type, str]:
    """(the dataclass that declares dotted `key`, the field's own name)."""
    *tables, name = key.split(".")
    for table in tables:
        section_cls = field_types(section_cls)[table]
    return section_cls, name


def get_key(section, key: str) -> Any:
    """The value of dotted `key` in a section object."""
    for name in key.split("."):
        section = getattr(section, name)
    return section


def set_key(section, key: str, value: Any) -> None:
    *tables, name = key.split(".")
    for table in tables:
        section = getattr(section, table)
    setattr(section, name, value)


def flat_items(table: dict, section_cls: type, prefix: str = ""):
    """(dotted key, value) of a section's TOML table: the tables of its table fields are
    flattened, anything else (an unknown or ignored table included) is one item."""
    types_ = field_types(section_cls)
    for key, value in table.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(types_.get(key)):
            yield from flat_items(value, types_[key], f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@functools.lru_cache(maxsize=None)
def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring below each field: the string literal that follows its annotated assignment."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} (optional)"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------------
# Value conversion


def convert(value: Any, tp: Any, where: str, from_text: bool = False) -> Any:
    """Convert a TOML value, or a command-line string (from_text), to the field type `tp`.

    TOML values are typed already and must match (steps = "10" is an error); command-line text is
    parsed. Raises ConfigError naming `where`.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)][0]
        if from_text and value.strip().lower() in ("", "none", "null"):
            return None
        return convert(value, inner, where, from_text)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where}: {shown(value)} is not valid; choose one of {', '.join(map(repr, args))}{hint}")
        return value
    if origin is list and dataclasses.is_dataclass(args[0]):
        return convert_tables(value, args[0], where, from_text)
    if origin is list and typing.get_origin(args[0]) is list and from_text:
        return convert(json_list(value, where), tp, where)  # a list of lists: JSON on the command line
    if origin is list:
        items = [v.strip() for v in value.split(",") if v.strip()] if from_text else value
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        return [convert(v, args[0], where, from_text) for v in items]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # a TOML integer beyond 1.8e308
                raise ConfigError(f"{where}: expected a number, got an integer too large for a float") from None
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {shown(value)}")
    raise TypeError(f"unsupported config field type {tp!r}")  # a bug in job_config.py, not a user error


def json_list(text: str, where: str) -> list:
    """A list of lists written on the command line: as JSON ([["a", "b"], ["c"]])."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python reads
        value = None
    if not isinstance(value, list):
        raise ConfigError(f'{where}: a list of lists, written as JSON: [["a", "b"], ["c"]]; got {shown(text)}')
    return value


def convert_tables(value: Any, cls: type, where: str, from_text: bool) -> list:
    """A TOML array of tables ([[section.key]]) -> a list of `cls` dataclasses."""
    if from_text:
        name = where.removeprefix("argument --")
        raise ConfigError(f"{where}: a list of tables, set in the TOML file as [[{name}]] tables, not on the command line")
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"{where}: expected [[...]] tables, got {shown(value)}")
    types_ = field_types(cls)
    entries = []
    for index, table in enumerate(value):
        entry = cls()
        for key, item in table.items():
            if key not in types_:
                raise ConfigError(f"{where}[{index}]: unknown key {shown(key)}{suggestion(key, list(types_))}; "
                                  f"valid keys: {', '.join(types_)}")
            setattr(entry, key, convert(item, types_[key], f"{where}[{index}].{key}"))
        entries.append(entry)
    return entries


def suggestion(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_key(section: str, key: str, candidates: list[str]) -> str:
    """"unknown key" and what may have been meant: the reason a torchtitan key is not
    implemented, or the closest known key."""
    why = REFUSED.get(f"{section}.{key}")
    key = key if len(key) <= 80 else f"{key[:75]} ..."  # as typed, but not a megabyte of it
    if why:
        return (f"unknown key {section}.{key}: torchtitan's option, refused here: {why} "
                "(docs/configuration.md, Coming from torchtitan)")
    return f"unknown key {section}.{key}{suggestion(key, candidates)}"


# ---------------------------------------------------------------------------------------------
# Sources: TOML file and command line


def resolve_config_file(name: str) -> Path:
    """A path as given, else relative to the working directory, else in train_configs/."""
    candidates = [Path(name).expanduser()]
    if not Path(name).is_absolute():
        candidates.append(TRAIN_CONFIGS_DIR / name)
    for path in candidates:
        try:
            if path.is_file():
                return path
        except (OSError, ValueError) as e:  # a name too long, or with a NUL or half a surrogate pair
            raise ConfigError(f"job.config_file: {shown(name)} is not a file name the system takes "
                              f"({e.__class__.__name__}: {shown(str(e))})") from None
    tried = ", ".join(shown(str(p)) for p in candidates)
    available = sorted(p.name for p in TRAIN_CONFIGS_DIR.glob("*.toml"))
    raise ConfigError(f"job.config_file: {shown(name)} not found (looked at {tried}); shipped configs: "
                      f"{', '.join(available)}")


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a TOML file is UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{path}: arrays or tables nested too deeply to read; a config nests a few levels") from None
    except ValueError:  # what Python itself refuses to read: an integer of more than 4300 digits
        raise ConfigError(f"{path}: holds an integer of more digits than Python reads (4300)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror}") from None


def parse_cli(argv: list[str]) -> list[tuple[str, str, Any]]:
    """Turn arguments into (section, key, raw value) triples; raw values stay strings or bools.
    A torchtitan option this trainer ignores (trainer.config.torchtitan_keys) comes out as well, its key
    dotted as typed (quantize, "linear.float8.emulate"): load_config names and drops it."""
    known = sections()
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"argument {shown(arg)}: expected --section.key [value] (see --help)")
        name, has_value, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        key = key.replace("-", "_")
        ignored_key = ignored_option(section, key)
        if ignored_key is not None:
            # Its type is not known here: a bare flag unless a value follows (no option does).
            if has_value:
                overrides.append((section, ignored_key, value))
                i += 1
            elif ignored_key != key or i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                overrides.append((section, ignored_key, ignored_key == key))  # --x.no_flag: false
                i += 1
            else:
                overrides.append((section, ignored_key, argv[i + 1]))
                i += 2
            continue
        if section not in known:
            raise ConfigError(f"argument {shown(arg)}: unknown section {shown(section)}"
                              f"{suggestion(section, [*known, *IGNORED_SECTIONS])}")
        cls = known[section]
        types_ = leaf_types(cls)
        positive = without_no(key)
        if positive in types_ and types_[positive] is bool:
            if has_value:
                raise ConfigError(f"argument {shown(arg)}: takes no value")
            overrides.append((section, positive, False))
            i += 1
            continue
        if key not in types_:
            known_keys = [*types_, *IGNORED_KEYS.get(section, ())]
            raise ConfigError(f"argument {shown(arg)}: {unknown_key(section, key, known_keys)}")
        if has_value:
            overrides.append((section, key, value))
            i += 1
        elif types_[key] is bool:
            # A bare flag is true; a following boolean word is taken as its value.
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in BOOL_WORDS:
                overrides.append((section, key, nxt))
                i += 2
            else:
                overrides.append((section, key, True))
                i += 1
        else:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and "." in argv[i + 1]):
                raise ConfigError(f"argument {shown(arg)}: missing value ({type_name(types_[key])})")
            overrides.append((section, key, argv[i + 1]))
            i += 2
    return overrides


def without_no(key: str) -> str | None:
    """The flag a negated key names ("linear.float8.no_emulate" -> "linear.float8.emulate"), or
    None when `key` is not negated."""
    tables, dot, name = key.rpartition(".")
    return f"{tables}{dot}{name[3:]}" if name.startswith("no_") else None


def ignored_option(section: str, key: str) -> str | None:
    """The key of a command-line option this trainer ignores (`no_` dropped from a negated
    flag), or None when the option is not one of trainer.config.torchtitan_keys's."""
    if is_ignored(section, key):
        return key
    positive = without_no(key)
    if positive is not None and is_ignored(section, positive):
        return positive
    return None


def apply_toml(config: JobConfig, data: dict, path: Path) -> list[str]:
    """Set values from a parsed TOML table; returns the names of ignored torchtitan options."""
    known = sections()
    ignored = []
    for section, table in data.items():
        if section in IGNORED_SECTIONS:
            ignored.append(f"[{section}]")
            continue
        if section not in known:
            raise ConfigError(f"{path}: unknown section [{section}]{suggestion(section, list(known))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {shown(table)}")
        cls = known[section]
        types_ = leaf_types(cls)
        target = getattr(config, section)
        for key, value in flat_items(table, cls):
            if is_ignored(section, key):
                ignored.append(f"{section}.{key}")
                continue
            if key not in types_:
                raise ConfigError(f"{path}: {unknown_key(section, key, list(types_))}")
            set_key(target, key, convert(value, types_[key], f"{path}: {section}.{key}"))
    return ignored


# ---------------------------------------------------------------------------------------------
# Entry points


def with_default_config(argv: list[str]) -> list[str]:
    """The command line of an entry point (the launcher, `python -m trainer.train`, the preflight):
    without --job.config_file, the embedded default config, as torchrun_launch.sh passes it.
    `--job.config_file ""` asks for the bare dataclass defaults."""
    if any(arg == "--job.config_file" or arg.startswith("--job.config_file=") for arg in argv):
        return list(argv)
    return ["--job.config_file", DEFAULT_CONFIG_FILE, *argv]


def load_config(argv: list[str]) -> JobConfig:
    """Defaults, then the TOML named by --job.config_file, then the other overrides; validated."""
    config = JobConfig()
    overrides = parse_cli(argv)
    config_files = [value for section, key, value in overrides if (section, key) == ("job", "config_file")]
    path = resolve_config_file(str(config_files[-1])) if config_files and config_files[-1] else None
    ignored = {}
    if path is not None:
        ignored[str(path)] = apply_toml(config, read_toml(path), path)
    ignored["command line"] = list(dict.fromkeys(f"--{section}.{key}" for section, key, _ in overrides
                                                 if is_ignored(section, key)))
    overrides = [(section, key, value) for section, key, value in overrides if not is_ignored(section, key)]
    if any(ignored.values()):
        # The launcher warns once for the whole run; its ranks, loading the same config, keep the
        # warning for their record without printing it again (trainer/messages.py).
        logger.warning("ignoring options this trainer does not implement (torchtitan's; docs/configuration.md "
                       "lists them): %s", "; ".join(f"{where}: {', '.join(names)}" for where, names in ignored.items()
                                                  if names), extra=SHOWN if os.environ.get(IGNORED_SHOWN) else None)
    known = sections()
    for section, key, value in overrides:
        set_key(getattr(config, section), key, convert(value, leaf_types(known[section])[key],
                                                        f"argument --{section}.{key}", from_text=isinstance(value, str)))
    config.job.config_file = str(path) if path is not None else ""
    inherit_unset(config)
    validate(config)
    return config


def inherit_unset(config: JobConfig) -> None:
    """Keys whose unset value means "as another key": validation batches take training's shape,
    and full bfloat16 training computes in bfloat16 (mixed_precision_param auto)."""
    v, t = config.validation, config.training
    if v.local_batch_size is None:
        v.local_batch_size = t.local_batch_size
    if v.seq_len is None:
        v.seq_len = t.seq_len
    if t.dtype == "bfloat16" and t.mixed_precision_param == "auto":
        t.mixed_precision_param = "bfloat16"


def to_dict(config: JobConfig) -> dict:
    """Nested dict without unset (None) values: TOML has no null, and None is always the default."""

    def without_none(table: dict) -> dict:
        return {k: without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}

    return {section: without_none(dataclasses.asdict(getattr(config, section))) for section in sections()}


def to_toml(config: JobConfig) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(config))


def help_text(config: JobConfig | None = None) -> str:
    """Every key with its type, default and doc; values a loaded config changes are shown too."""
    defaults = JobConfig()
    lines = [
        "usage: torchrun_launch.sh [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: command line > TOML file > defaults. Booleans: --section.flag, --section.no_flag,",
        "--section.flag=false. Lists: comma separated. --job.print_config prints the resolved TOML.",
    ]
    for section, cls in sections().items():
        lines += ["", f"[{section}]  {inspect.cleandoc(cls.__doc__ or '')}"]
        for key, tp in leaf_types(cls).items():
            owner, name = leaf_owner(cls, key)
            default = get_key(getattr(defaults, section), key)
            head = f"  --{section}.{key}  ({type_name(tp)}, default {default!r})"
            if config is not None and get_key(getattr(config, section), key) != default:
                head += f"  [config: {get_key(getattr(config, section), key)!r}]"
            lines.append(head)
            rule = declared(owner, name)
            if rule is not None:
                lines.append(f"      valid: {rule.text(short=True)}")
            lines += [f"      {line}" for line in field_docs(owner).get(name, "").splitlines()]
    return "\n".join(lines)
