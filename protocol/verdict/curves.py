"""Loss curves read from a run's metrics.jsonl or from TensorBoard event files.

A `Curve` is what the comparison needs from a run: logged steps, loss and (when known) gradient
norm per step, and the other per-step figures the report shows (learning rate, step time,
tokens/s, peak memory) when the source has them. `read_curve` accepts

* a dump folder holding ``metrics.jsonl`` (what this trainer writes),
* a ``metrics.jsonl`` file itself,
* a folder searched recursively for ``events.out.tfevents.*`` (this trainer's ``tb/`` folder, or
  the TensorBoard output of another trainer, so that its curves can serve as control or test).

A resumed run logs some steps twice; the value written last wins, and steps come out sorted.
"""

from __future__ import annotations

import json
import logging
import math
import re
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVENTS_GLOB = "events.out.tfevents.*"

# Tags tried in order when none is given. This trainer and torchtitan share the first ones; the
# bare names cover simple SummaryWriter scripts.
DEFAULT_LOSS_TAGS = ("loss_metrics/global_avg_loss", "loss", "train/loss")
DEFAULT_GRAD_NORM_TAGS = ("grad_norm", "loss_metrics/grad_norm", "train/grad_norm")

# Other per-step figures: name in Curve.extra -> TensorBoard tags tried (this trainer's, torchtitan's).
EXTRA_TAGS = {"lr": ("lr", "lr_metrics/lr"), "tokens_per_s": ("throughput/tps", "throughput(tps)")}
# A TensorBoard tag given for a metrics.jsonl run means the jsonl key the trainer writes next to it.
_JSONL_KEY_OF_TAG = {"loss_metrics/global_avg_loss": "loss"}

_RANK_DIR = re.compile(r"^rank_(\d+)$")


class CurveError(ValueError):
    """A curve cannot be read; the message names the path and what is wrong."""


@dataclass
class Curve:
    """One run's loss (and gradient norm) per logged step, steps ascending and unique."""

    name: str
    steps: list[int]
    loss: list[float]
    grad_norm: list[float] | None
    source: str
    """Where it was read from (file or folder), for messages and reports."""
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Other figures per step, NaN where a step lacks them: "lr", "step_time_s", "tokens_per_s",
    "peak_memory_gib" (whichever the source logged)."""
    skipped: list[int] = field(default_factory=list)
    """float16 steps the loss scaler skipped for an overflow (logged with a loss and no gradient
    norm): their update never happened, so they are not compared."""

    def __post_init__(self) -> None:
        if len(self.loss) != len(self.steps):
            raise ValueError(f"curve {self.name!r}: {len(self.steps)} steps but {len(self.loss)} loss values")
        if self.grad_norm is not None and len(self.grad_norm) != len(self.steps):
            raise ValueError(f"curve {self.name!r}: {len(self.steps)} steps but {len(self.grad_norm)} grad norms")
        for key, values in self.extra.items():
            if len(values) != len(self.steps):
                raise ValueError(f"curve {self.name!r}: {len(self.steps)} steps but {len(values)} values of {key}")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError(f"curve {self.name!r}: steps must be strictly increasing")

    def series(self, key: str) -> list[float] | None:
        """The per-step values of "loss", "grad_norm" or a key of `extra` (None when not logged)."""
        if key == "loss":
            return self.loss
        if key == "grad_norm":
            return self.grad_norm
        return self.extra.get(key)

    def renamed(self, name: str) -> "Curve":
        return dataclasses.replace(self, name=name)


def read_curve(
    path: str | Path,
    name: str | None = None,
    loss_tag: str | None = None,
    grad_norm_tag: str | None = None,
) -> Curve:
    """Read a curve from a dump folder, a metrics.jsonl file or a TensorBoard event folder.

    A folder with a metrics.jsonl is read from that file (it holds every logged step, whereas
    TensorBoard may be disabled or written per rank). `loss_tag` / `grad_norm_tag` choose the
    TensorBoard tags, or for metrics.jsonl the record key; without them the defaults of this
    trainer and torchtitan are tried, and a missing gradient norm is not an error.
    `name` defaults to the run folder's name.
    """
    path = Path(path)
    if not path.exists():
        raise CurveError(f"{path}: no such file or folder")
    if path.is_file():
        if path.name.startswith("events.out.tfevents."):
            return _read_events([path], path, name or path.parent.name, loss_tag, grad_norm_tag)
        return _read_jsonl(path, name or path.parent.name, loss_tag, grad_norm_tag)
    default_name = name or path.name
    if (path / METRICS_FILE).is_file():
        return _read_jsonl(path / METRICS_FILE, default_name, loss_tag, grad_norm_tag)
    event_files = sorted(path.rglob(EVENTS_GLOB))
    if not event_files:
        raise CurveError(f"{path}: neither {METRICS_FILE} nor TensorBoard event files ({EVENTS_GLOB}) found in it")
    return _read_events(event_files, path, default_name, loss_tag, grad_norm_tag)


# ---------------------------------------------------------------- metrics.jsonl
def _read_jsonl(path: Path, name: str, loss_tag: str | None, grad_norm_tag: str | None) -> Curve:
    """Training records are those without a "kind" key (trainer/metrics/step_log.py); an explicit key
    (e.g. "validation/loss") selects every record that has it instead."""
    loss_key = _JSONL_KEY_OF_TAG.get(loss_tag, loss_tag) if loss_tag else "loss"
    grad_key = _JSONL_KEY_OF_TAG.get(grad_norm_tag, grad_norm_tag) if grad_norm_tag else "grad_norm"
    records = list(_jsonl_records(path))
    if loss_tag is None:
        selected = [(n, r) for n, r in records if "kind" not in r]
    else:
        selected = [(n, r) for n, r in records if loss_key in r]
        if not selected:
            raise CurveError(f"{path}: no record has the key {loss_key!r}; keys found: "
                             f"{', '.join(sorted({k for _, r in records for k in r}))}")
    loss: dict[int, float] = {}
    grad: dict[int, float] = {}
    extra: dict[str, dict[int, float]] = {}
    skipped: dict[int, bool] = {}
    for lineno, record in selected:
        step = int(_field(record, "step", path, lineno))
        loss[step] = float(_field(record, loss_key, path, lineno))
        skipped[step] = record.get("step_skipped") is True
        if grad_key in record and record[grad_key] is not None:
            grad[step] = float(_field(record, grad_key, path, lineno))
        for key, value in _extra_figures(record).items():
            extra.setdefault(key, {})[step] = value
    if not loss:
        raise CurveError(f"{path}: no training steps logged")
    if grad_norm_tag is not None and not grad:
        raise CurveError(f"{path}: no record has the key {grad_key!r}")
    return _build(name, loss, grad, str(path), extra, sorted(s for s, was in skipped.items() if was))


def _extra_figures(record: dict) -> dict[str, float]:
    """The report's other figures of one metrics.jsonl record (trainer/metrics/step_log.py): learning
    rate, step time, tokens/s, and the peak memory (CUDA reserved, else the process's RSS)."""
    found = {key: float(record[key]) for key in ("lr", "step_time_s", "tokens_per_s")
             if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    memory = record.get("memory")
    if isinstance(memory, dict):
        peak = memory.get("max_reserved_gib", memory.get("peak_rss_gib"))
        if isinstance(peak, (int, float)):
            found["peak_memory_gib"] = float(peak)
    return found


def _jsonl_records(path: Path) -> Iterable[tuple[int, dict]]:
    """(line number, record) for each non-blank line. Python's json reads NaN/Infinity, which a
    diverged run writes."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CurveError(f"{path}: cannot be read ({e})") from e
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CurveError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from e
        except RecursionError:
            raise CurveError(f"{path}:{lineno}: not a metrics record (nested too deeply)") from None
        if not isinstance(record, dict):
            raise CurveError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record


def _field(record: dict, key: str, path: Path, lineno: int):
    value = record.get(key)
    if key == "step":
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or value != int(value)):
            raise CurveError(f"{path}:{lineno}: 'step' must be an integer, got {value!r}")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CurveError(f"{path}:{lineno}: {key!r} must be a number, got {value!r}")
    return value


# ---------------------------------------------------------------- TensorBoard
def _read_events(
    files: list[Path], root: Path, name: str, loss_tag: str | None, grad_norm_tag: str | None
) -> Curve:
    files = _one_rank(files)
    scalars = _load_scalars(files)
    available = sorted(scalars)
    loss_name = _pick_tag(scalars, loss_tag, DEFAULT_LOSS_TAGS)
    if loss_name is None:
        wanted = repr(loss_tag) if loss_tag else "any of " + ", ".join(DEFAULT_LOSS_TAGS)
        raise CurveError(f"{root}: loss tag {wanted} not found; tags found: {', '.join(available) or 'none'}")
    grad_name = _pick_tag(scalars, grad_norm_tag, DEFAULT_GRAD_NORM_TAGS)
    if grad_norm_tag is not None and grad_name is None:
        raise CurveError(f"{root}: grad-norm tag {grad_norm_tag!r} not found; tags found: {', '.join(available)}")
    logger.debug("%s: loss from tag %r, grad norm from %r", root, loss_name, grad_name)
    grad = _last_wins(scalars[grad_name]) if grad_name else {}
    extra = {key: _last_wins(scalars[tag]) for key, tag in
             ((key, _pick_tag(scalars, None, tags)) for key, tags in EXTRA_TAGS.items()) if tag}
    return _build(name, _last_wins(scalars[loss_name]), grad, str(root), extra)


def _one_rank(files: list[Path]) -> list[Path]:
    """With metrics.save_for_all_ranks every rank has a rank_<r> folder; keep the lowest rank so
    that one run's steps are not merged with another rank's copy of them."""
    ranks = {}
    for f in files:
        match = _RANK_DIR.match(f.parent.name)
        if match:
            ranks[f] = int(match.group(1))
    if not ranks:
        return files
    lowest = min(ranks.values())
    kept = [f for f in files if ranks.get(f, lowest) == lowest]
    logger.info("TensorBoard events of several ranks found; reading rank_%d", lowest)
    return kept


def _load_scalars(files: list[Path]) -> dict[str, list[tuple[float, int, float]]]:
    """tag -> [(wall time, step, value)] over all files; scalars written as simple values or as
    0-d tensors (TF2-style writers) alike."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    found: dict[str, list[tuple[float, int, float]]] = {}
    for path in files:
        acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        try:
            acc.Reload()
            tags = acc.Tags()
            for tag in tags.get(ea.SCALARS, []):
                found.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
            for tag in tags.get(ea.TENSORS, []):
                values = [(e.wall_time, e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
                if values and all(v.size == 1 for _, _, v in values):
                    found.setdefault(tag, []).extend((w, s, float(v.reshape(()))) for w, s, v in values)
        except Exception as e:  # corrupt or truncated files raise assorted tensorboard/protobuf errors
            raise CurveError(f"{path}: cannot read TensorBoard events ({type(e).__name__}: {e})") from e
    return found


def _pick_tag(scalars: dict, given: str | None, defaults: tuple[str, ...]) -> str | None:
    if given is not None:
        return given if given in scalars else None
    return next((tag for tag in defaults if tag in scalars), None)


def _last_wins(events: list[tuple[float, int, float]]) -> dict[int, float]:
    """Later-written values replace earlier ones of the same step (a resumed run re-logs steps)."""
    by_step: dict[int, float] = {}
    for _, step, value in sorted(events, key=lambda e: e[0]):
        by_step[int(step)] = float(value)
    return by_step


# ---------------------------------------------------------------- common
def _build(name: str, loss: dict[int, float], grad: dict[int, float], source: str,
           extra: dict[str, dict[int, float]] | None = None, skipped: list[int] | None = None) -> Curve:
    """Sorted steps; grad norm None when absent, NaN at steps that lack it when partly present
    (a float16 step skipped for an overflow logs no norm)."""
    steps = sorted(loss)
    grad_norm = [grad.get(s, math.nan) for s in steps] if grad else None
    missing = len(steps) - len(grad.keys() & loss.keys())
    if grad and missing:
        logger.info("%s: %d logged steps have no grad norm", source, missing)
    others = {key: [values.get(s, math.nan) for s in steps] for key, values in (extra or {}).items() if values}
    return Curve(name=name, steps=steps, loss=[loss[s] for s in steps], grad_norm=grad_norm, source=source,
                 extra=others, skipped=list(skipped or []))
