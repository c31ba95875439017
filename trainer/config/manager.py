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
import logging
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from trainer.config.ignored import IGNORED_KEYS, IGNORED_SECTIONS
from trainer.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS_DIR = REPO_ROOT / "train_configs"
DEFAULT_CONFIG_FILE = "debug_model.toml"  # what the entry points train without --job.config_file
BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class ConfigError(ValueError):
    """A mistake in the configuration a user can fix; the message says how."""


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
            raise ConfigError(f"{where}: {value!r} is not valid; choose one of {', '.join(map(repr, args))}{hint}")
        return value
    if origin is list and dataclasses.is_dataclass(args[0]):
        return convert_tables(value, args[0], where, from_text)
    if origin is list:
        items = [v.strip() for v in value.split(",") if v.strip()] if from_text else value
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [convert(v, args[0], where, from_text) for v in items]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config field type {tp!r}")  # a bug in job_config.py, not a user error


def convert_tables(value: Any, cls: type, where: str, from_text: bool) -> list:
    """A TOML array of tables ([[section.key]]) -> a list of `cls` dataclasses."""
    if from_text:
        name = where.removeprefix("argument --")
        raise ConfigError(f"{where}: a list of tables, set in the TOML file as [[{name}]] tables, not on the command line")
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ConfigError(f"{where}: expected [[...]] tables, got {value!r}")
    types_ = field_types(cls)
    entries = []
    for index, table in enumerate(value):
        entry = cls()
        for key, item in table.items():
            if key not in types_:
                raise ConfigError(f"{where}[{index}]: unknown key {key!r}{suggestion(key, list(types_))}; "
                                  f"valid keys: {', '.join(types_)}")
            setattr(entry, key, convert(item, types_[key], f"{where}[{index}].{key}"))
        entries.append(entry)
    return entries


def suggestion(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------------------------------------
# Sources: TOML file and command line


def resolve_config_file(name: str) -> Path:
    """A path as given, else relative to the working directory, else in train_configs/."""
    candidates = [Path(name).expanduser()]
    if not Path(name).is_absolute():
        candidates.append(TRAIN_CONFIGS_DIR / name)
    for path in candidates:
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    available = sorted(p.name for p in TRAIN_CONFIGS_DIR.glob("*.toml"))
    raise ConfigError(f"job.config_file: {name!r} not found (looked at {tried}); shipped configs: {', '.join(available)}")


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror}") from None


def parse_cli(argv: list[str]) -> list[tuple[str, str, Any]]:
    """Turn arguments into (section, key, raw value) triples; raw values stay strings or bools."""
    known = sections()
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"argument {arg!r}: expected --section.key [value] (see --help)")
        name, has_value, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        key = key.replace("-", "_")
        if section not in known:
            raise ConfigError(f"argument {arg!r}: unknown section {section!r}{suggestion(section, list(known))}")
        cls = known[section]
        types_ = field_types(cls)
        negated = key.startswith("no_") and key[3:] in types_ and types_[key[3:]] is bool
        if negated:
            if has_value:
                raise ConfigError(f"argument {arg!r}: --{section}.{key} takes no value")
            overrides.append((section, key[3:], False))
            i += 1
            continue
        if key not in types_:
            raise ConfigError(f"argument {arg!r}: unknown key {section}.{key}{suggestion(key, list(types_))}")
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
                raise ConfigError(f"argument {arg!r}: missing value ({type_name(types_[key])})")
            overrides.append((section, key, argv[i + 1]))
            i += 2
    return overrides


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
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {table!r}")
        cls = known[section]
        types_ = field_types(cls)
        target = getattr(config, section)
        for key, value in table.items():
            if key in IGNORED_KEYS.get(section, ()):
                ignored.append(f"{section}.{key}")
                continue
            if key not in types_:
                raise ConfigError(f"{path}: unknown key {section}.{key}{suggestion(key, list(types_))}")
            setattr(target, key, convert(value, types_[key], f"{path}: {section}.{key}"))
    return ignored


# ---------------------------------------------------------------------------------------------
# Validation of values (parallel degrees against a world size are checked in trainer.parallel.dims)


def validate(config: JobConfig) -> None:
    """Check values every run needs; raise ConfigError listing every problem found."""
    from trainer.models.llama3.hf_config import HFConfigError, configured_model_args, flavor_names  # light: no torch

    c = config
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(c.model.flavor in flavor_names(),
         f"model.flavor: {c.model.flavor!r} is unknown; choose one of {', '.join(flavor_names())}")
    if c.model.flavor == "hf" or c.model.hf_assets_path:
        try:
            configured_model_args(c.model)
            if c.model.hf_assets_path and not Path(c.model.hf_assets_path).is_dir():
                raise HFConfigError(f"model.hf_assets_path: {c.model.hf_assets_path} is not a folder")
        except (HFConfigError, ValueError) as e:
            problems.append(str(e))
    need(c.training.steps >= 1, f"training.steps: must be >= 1, got {c.training.steps}")
    need(c.training.local_batch_size >= 1, f"training.local_batch_size: must be >= 1, got {c.training.local_batch_size}")
    need(
        c.training.global_batch_size == -1 or c.training.global_batch_size >= 1,
        f"training.global_batch_size: must be -1 (local x data-parallel degree) or >= 1, got {c.training.global_batch_size}",
    )
    need(c.training.seq_len >= 2, f"training.seq_len: must be >= 2, got {c.training.seq_len}")
    need(c.training.stream_lanes >= 1, f"training.stream_lanes: must be >= 1, got {c.training.stream_lanes}")
    need(c.training.stream_workers >= 0, f"training.stream_workers: must be >= 0, got {c.training.stream_workers}")
    need(c.training.stream_prefetch >= 1, f"training.stream_prefetch: must be >= 1, got {c.training.stream_prefetch}")
    for key in ("loss_scale_initial", "loss_scale_min"):
        value = getattr(c.training, key)
        need(value > 0 and math.frexp(value)[0] == 0.5, f"training.{key}: must be a power of two (so that unscaling "
             f"is exact), e.g. 65536 or 1, got {value}")
    need(c.training.loss_scale_min <= c.training.loss_scale_initial,
         f"training.loss_scale_min: must be <= training.loss_scale_initial ({c.training.loss_scale_initial}), "
         f"got {c.training.loss_scale_min}")
    need(c.training.loss_scale_growth_interval >= 1,
         f"training.loss_scale_growth_interval: must be >= 1, got {c.training.loss_scale_growth_interval}")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        need(getattr(c.comm, key) >= 1, f"comm.{key}: must be >= 1 (seconds), got {getattr(c.comm, key)}")
    need(c.training.gc_freq >= 1, f"training.gc_freq: must be >= 1, got {c.training.gc_freq}")
    need(c.optimizer.lr >= 0, f"optimizer.lr: must be >= 0, got {c.optimizer.lr}")
    for key in ("beta1", "beta2"):
        beta = getattr(c.optimizer, key)
        need(0.0 <= beta < 1.0, f"optimizer.{key}: must be in [0, 1), got {beta}")
    need(c.optimizer.eps > 0, f"optimizer.eps: must be > 0, got {c.optimizer.eps}")
    need(c.optimizer.weight_decay >= 0, f"optimizer.weight_decay: must be >= 0, got {c.optimizer.weight_decay}")
    need(c.lr_scheduler.warmup_steps >= 0, f"lr_scheduler.warmup_steps: must be >= 0, got {c.lr_scheduler.warmup_steps}")
    ratio = c.lr_scheduler.decay_ratio
    need(ratio is None or 0.0 <= ratio <= 1.0, f"lr_scheduler.decay_ratio: must be in [0, 1] or unset, got {ratio}")
    need(
        0.0 <= c.lr_scheduler.min_lr_factor <= 1.0,
        f"lr_scheduler.min_lr_factor: must be in [0, 1], got {c.lr_scheduler.min_lr_factor}",
    )
    need(0 <= c.debug.init_perturbation <= 64, "debug.init_perturbation: must be in [0, 64] rounding errors of the "
         f"compute dtype (1 is the protocol's noise controls; 0 is off), got {c.debug.init_perturbation}")
    need(c.metrics.log_freq >= 1, f"metrics.log_freq: must be >= 1, got {c.metrics.log_freq}")
    need(c.metrics.peak_flops >= 0, f"metrics.peak_flops: must be >= 0, got {c.metrics.peak_flops}")
    prof = c.profiling  # checked also when off: a typo shows at once, not when profiling is turned on
    need(prof.profile_freq >= 1, f"profiling.profile_freq: must be >= 1, got {prof.profile_freq}")
    need(prof.profiler_warmup >= 0, f"profiling.profiler_warmup: must be >= 0, got {prof.profiler_warmup}")
    need(prof.profiler_active >= 1, f"profiling.profiler_active: must be >= 1, got {prof.profiler_active}")
    need(prof.profiler_warmup + prof.profiler_active <= prof.profile_freq,
         f"profiling.profiler_warmup + profiling.profiler_active: {prof.profiler_warmup} + {prof.profiler_active} steps "
         f"must fit in one profiling.profile_freq window of {prof.profile_freq} steps (windows must not overlap); "
         f"lower them or raise profile_freq to at least {prof.profiler_warmup + prof.profiler_active}")
    need(c.checkpoint.interval >= 1, f"checkpoint.interval: must be >= 1, got {c.checkpoint.interval}")
    need(c.checkpoint.keep_latest_k >= 0, f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {c.checkpoint.keep_latest_k}")
    need(c.checkpoint.load_step >= -1, f"checkpoint.load_step: must be -1 (newest) or a step, got {c.checkpoint.load_step}")
    need(not c.checkpoint.last_save_in_hf or c.checkpoint.enable,
         "checkpoint.last_save_in_hf: needs checkpoint.enable (the export is part of the last save)")
    need(not c.checkpoint.initial_load_in_hf or bool(c.checkpoint.initial_load_path),
         "checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path (the Hugging Face folder)")
    loadable = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    for item in c.checkpoint.exclude_from_loading:
        need(item in loadable, f"checkpoint.exclude_from_loading: {item!r} is unknown; choose from {', '.join(sorted(loadable))}")
    for item in c.compile.components:
        need(item in ("model", "loss"), f"compile.components: {item!r} is unknown; choose from 'model', 'loss'")
    option = c.activation_checkpoint.selective_ac_option
    need(
        option == "op" or (option.isdigit() and int(option) >= 1),
        f"activation_checkpoint.selective_ac_option: must be 'op' or a positive integer, got {option!r}",
    )
    p = c.parallelism
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        need(getattr(p, key) >= 1, f"parallelism.{key}: must be >= 1, got {getattr(p, key)}")
    need(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree: must be -1 (the rest of the world) or >= 1, got {p.data_parallel_shard_degree}",
    )
    need(
        p.pipeline_parallel_microbatch_size >= 1,
        f"parallelism.pipeline_parallel_microbatch_size: must be >= 1, got {p.pipeline_parallel_microbatch_size}",
    )
    need(p.context_parallel_rotate_method == "allgather",
         f"parallelism.context_parallel_rotate_method: {p.context_parallel_rotate_method!r} is not available; context "
         "parallelism here gathers keys and values ('allgather')")
    for key in ("validation.global_batch_size", "validation.local_batch_size", "validation.seq_len", "validation.freq",
                "validation.steps"):
        section, name = key.split(".")
        need(getattr(getattr(c, section), name) >= 1, f"{key}: must be >= 1, got {getattr(getattr(c, section), name)}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


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
    if path is not None:
        ignored = apply_toml(config, read_toml(path), path)
        if ignored:
            logger.warning("%s: ignoring options this trainer does not implement: %s", path, ", ".join(ignored))
    known = sections()
    for section, key, value in overrides:
        cls = known[section]
        setattr(getattr(config, section), key, convert(value, field_types(cls)[key], f"argument --{section}.{key}",
                                                        from_text=isinstance(value, str)))
    config.job.config_file = str(path) if path is not None else ""
    inherit_unset(config)
    validate(config)
    return config


def inherit_unset(config: JobConfig) -> None:
    """Keys whose unset value means "as another key": validation batches take training's shape."""
    v, t = config.validation, config.training
    if v.local_batch_size is None:
        v.local_batch_size = t.local_batch_size
    if v.seq_len is None:
        v.seq_len = t.seq_len


def to_dict(config: JobConfig) -> dict:
    """Nested dict without unset (None) values: TOML has no null, and None is always the default."""
    return {
        section: {k: v for k, v in dataclasses.asdict(getattr(config, section)).items() if v is not None}
        for section in sections()
    }


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
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            head = f"  --{section}.{f.name}  ({type_name(field_types(cls)[f.name])}, default {default!r})"
            if config is not None and getattr(getattr(config, section), f.name) != default:
                head += f"  [config: {getattr(getattr(config, section), f.name)!r}]"
            lines.append(head)
            lines += [f"      {line}" for line in docs.get(f.name, "").splitlines()]
    return "\n".join(lines)
