"""Turning measured step figures into log output.

The training loop measures (loss, gradient norm, tokens, seconds) and hands them over as a
`StepFigures`; this module derives throughput, TFLOPS, MFU and memory from them and writes

* one console line per logged step (through `logging`, on every rank; the launcher decides which
  rank's output is shown),
* one JSON object per logged step to ``<dump_folder>/metrics.jsonl`` (log rank only, flushed
  after every line so that a crashed or running job can be read),
* TensorBoard scalars under ``<dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMMSS>`` when enabled
  (``.../rank_<r>`` per rank with ``metrics.save_for_all_ranks``); a resumed run continues its
  own folder,
* the same scalars to a Weights & Biases run when enabled (files under ``<dump_folder>/wandb``;
  with ``metrics.save_for_all_ranks`` one run per rank, named ``rank_<r>``, grouped by the time
  stamp). Writers: trainer.metrics.writers.

run_meta.json, the run's record, is written by trainer.records.run_meta.

metrics.jsonl records
---------------------
Training steps (`MetricsLogger.log_step`) have no ``kind`` key::

    {"step", "loss", "grad_norm", "lr", "tokens" (cumulative), "tokens_per_s" (per device),
     "tflops" (per device), "mfu" (percent, null when the device peak is unknown),
     "memory" {...}, "time" (unix seconds), "step_time_s" (mean seconds per optimizer step)}

Other records (`MetricsLogger.log_scalars`, e.g. validation) carry ``"kind": <prefix>`` and keys
``"<prefix>/<name>"``. A diverged run writes ``NaN``/``Infinity`` for its loss, which Python's
``json`` reads back (strict JSON parsers do not).

TensorBoard and W&B tags
------------------------
``loss_metrics/global_avg_loss``, ``grad_norm``, ``lr``, ``throughput/tps``,
``throughput/tflops``, ``throughput/mfu_pct`` (only when known), ``memory/<key of memory_stats>``,
and ``<prefix>/<name>`` for `log_scalars`.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from trainer.metrics.writers import ScalarWriter, TensorBoardWriter, WandbWriter
from trainer.records.safe_writes import open_append

logger = logging.getLogger(__name__)

GIB = float(1 << 30)

METRICS_FILE = "metrics.jsonl"
_STAMP_FORMAT = "%Y%m%d-%H%M%S"

# Dense (no structured sparsity) BF16 tensor throughput of one device, in FLOP/s, keyed by a
# substring of torch.cuda.get_device_name(). Vendor datasheets quote the sparse figure for NVIDIA
# Hopper/Ada/Blackwell parts; the values here are half of it. Sources:
#   NVIDIA A100 datasheet (SXM and PCIe): 312 TFLOPS BF16.
#   NVIDIA H100 datasheet: SXM 1,979 sparse; PCIe 1,513 sparse; NVL 1,671 sparse.
#   NVIDIA H200 datasheet: SXM 1,979 sparse; NVL 1,671 sparse. GH200: the H100/H200 SXM figure.
#   NVIDIA HGX B200 datasheet: 4.5 PFLOPS sparse per GPU.
#   NVIDIA L40S datasheet: 733 sparse; L40 datasheet: 362 sparse; L4 datasheet: 242 sparse.
#   AMD Instinct MI300X datasheet: 1,307.4 TFLOPS BF16 dense; MI250X: 383 TFLOPS BF16.
# Left out on purpose: A10/A10G (the AWS A10G is not in an NVIDIA datasheet, and "A10" would
# also match it), consumer and workstation cards.
# Order matters: the first key contained in the device name wins, so a key that is a substring of
# another key ("H100" of "H100 PCIe", "H200" of "GH200", "L4" of "L40S") must come after it.
PEAK_BF16_DENSE_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "GH200": 989e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100": 989e12,  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "B200": 2.25e15,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}

_warned_unknown_devices: set[str] = set()


def peak_flops_per_device(device: torch.device, configured: float) -> float | None:
    """Peak FLOP/s of one device used as the MFU denominator.

    A configured value > 0 wins. On CUDA (and ROCm) the device name is looked up in
    `PEAK_BF16_DENSE_FLOPS`; an unknown name gives None and one warning per name. Other devices
    (CPU, ...) give None: MFU is then omitted.
    """
    if configured and configured > 0:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_DENSE_FLOPS.items():
        if key.upper() in name.upper():
            return flops
    if name not in _warned_unknown_devices:
        _warned_unknown_devices.add(name)
        logger.warning(
            "Peak FLOP/s of device %r is not in the built-in table; MFU will not be reported. "
            "Set metrics.peak_flops to the device's dense bf16 FLOP/s to report it.",
            name,
        )
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB: CUDA allocator peaks on CUDA, the process's peak RSS elsewhere."""
    if device.type == "cuda":
        return {
            "max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    rss_bytes = maxrss if sys.platform == "darwin" else maxrss * 1024
    return {"peak_rss_gib": rss_bytes / GIB}


def should_log(step: int, log_freq: int, total_steps: int) -> bool:
    """Log step 1, every log_freq-th step and the last step (log_freq <= 0: first and last only)."""
    if step == 1 or step == total_steps:
        return True
    return log_freq > 0 and step % log_freq == 0


@dataclass
class StepFigures:
    """What the loop measured since the previous logged step."""

    step: int
    loss: float
    """Global average loss of this step (ARCHITECTURE invariant 2)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    tokens: int
    """Tokens of the whole global batch processed since the previous logged step."""
    tokens_seen: int
    """Cumulative tokens since step 0."""
    elapsed_s: float
    """Wall seconds since the previous logged step."""
    steps_since_log: int
    """Optimizer steps that `tokens` and `elapsed_s` cover."""
    loss_scale: dict | None = None
    """float16 runs: the loss scaler's state after this step (scale, skipped_steps, ...)."""
    step_skipped: bool = False
    """float16 runs: this step's gradients overflowed and the optimizer did not step."""


def time_stamp() -> str:
    """The name of a new run's TensorBoard subfolder: the current time."""
    return datetime.now().strftime(_STAMP_FORMAT)


def console_is_terminal() -> bool:
    """Colors only on a terminal: log files (the launcher writes each rank's output to one) stay plain."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class _Colors:
    def __init__(self, enabled: bool):
        def code(seq: str) -> str:
            return seq if enabled else ""

        self.reset = code("\033[0m")
        self.step = code("\033[1;37m")
        self.loss = code("\033[91m")
        self.grad = code("\033[93m")
        self.lr = code("\033[96m")
        self.tps = code("\033[92m")
        self.flops = code("\033[94m")
        self.mfu = code("\033[95m")
        self.mem = code("\033[36m")


def _fmt(value: float) -> str:
    if isinstance(value, int):  # counts (tokens per source)
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def _step_scalars(record: dict) -> dict[str, float]:
    """The TensorBoard/W&B tags of a training step's metrics.jsonl record."""
    scalars = {"loss_metrics/global_avg_loss": record["loss"]}
    if record["grad_norm"] is not None:  # a skipped float16 step has none
        scalars["grad_norm"] = record["grad_norm"]
    scalars["lr"] = record["lr"]
    scalars["throughput/tps"] = record["tokens_per_s"]
    scalars["throughput/tflops"] = record["tflops"]
    if record["mfu"] is not None:
        scalars["throughput/mfu_pct"] = record["mfu"]
    scalars.update({f"memory/{key}": value for key, value in record["memory"].items()})
    if "loss_scale" in record:
        scalars["loss_scale/scale"] = record["loss_scale"]
        scalars["loss_scale/skipped_steps"] = record["skipped_steps"]
    return scalars


class MetricsLogger:
    """Console line, metrics.jsonl, TensorBoard and W&B for one rank.

    Construct it on every rank. `is_log_rank` marks the one rank that writes metrics.jsonl and
    (by default) TensorBoard and W&B; other ranks only log the console line and return records, plus
    their own TensorBoard folder and W&B run when metrics.save_for_all_ranks is set.

    metrics.jsonl is appended to: which records a start keeps of an earlier run is decided before,
    by trainer.records.run_meta. `run_stamp` names the TensorBoard subfolder (a resumed run passes its
    own, so that one run's curves stay in one folder); by default the current time (`time_stamp`).
    When every rank writes, rank 0's stamp is broadcast (it also names the group of the ranks' W&B
    runs), so other ranks may pass None. `purge_step`: TensorBoard hides the folder's events at and
    after this step (steps a resumed run trains again).
    """

    def __init__(
        self,
        job_config: Any,
        *,
        rank: int,
        is_log_rank: bool,
        world_size: int,
        device: torch.device,
        flops_per_token: float,
        run_stamp: str | None = None,
        purge_step: int | None = None,
    ):
        mcfg = job_config.metrics
        self.rank = rank
        self.is_log_rank = is_log_rank
        self.world_size = max(int(world_size), 1)
        self.device = torch.device(device)
        self.flops_per_token = float(flops_per_token)
        self.dump_folder = Path(job_config.job.dump_folder)
        self.metrics_path = self.dump_folder / METRICS_FILE
        self.colors = _Colors(not mcfg.disable_color_printing and console_is_terminal())
        self.peak_flops = peak_flops_per_device(self.device, mcfg.peak_flops)
        self.tb_dir: Path | None = None
        self._file = None
        self._writers: list[ScalarWriter] = []  # TensorBoard, W&B
        self._closed = False

        if is_log_rank:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            self._file = open_append(self.metrics_path)  # never through a link (trainer/records/safe_writes.py)

        if (is_log_rank or mcfg.save_for_all_ranks) and (mcfg.enable_tensorboard or mcfg.enable_wandb):
            self._open_writers(job_config, run_stamp, purge_step)

    def _open_writers(self, job_config: Any, run_stamp: str | None, purge_step: int | None) -> None:
        """TensorBoard and W&B of this rank. Per rank (save_for_all_ranks), every rank takes rank
        0's time stamp: the ranks' TensorBoard folders sit side by side, their W&B runs form one group."""
        mcfg = job_config.metrics
        per_rank = mcfg.save_for_all_ranks
        run_stamp = self._shared_stamp(run_stamp, broadcast=per_rank)
        if mcfg.enable_tensorboard:
            self.tb_dir = self.dump_folder / mcfg.save_tb_folder / run_stamp
            if per_rank:
                self.tb_dir = self.tb_dir / f"rank_{self.rank}"
            self._writers.append(TensorBoardWriter(self.tb_dir, purge_step))
        if mcfg.enable_wandb:
            from trainer.config.manager import to_dict

            self._writers.append(WandbWriter(self.dump_folder, to_dict(job_config),
                                             name=f"rank_{self.rank}" if per_rank else None,
                                             group=run_stamp if per_rank else None))

    def _shared_stamp(self, stamp: str | None, broadcast: bool) -> str:
        stamp = stamp or time_stamp()
        dist = torch.distributed
        if broadcast and self.world_size > 1 and dist.is_available() and dist.is_initialized():
            box = [stamp]
            dist.broadcast_object_list(box, src=0, device=self.device)
            stamp = box[0]
        return stamp

    # ------------------------------------------------------------------ writing
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def log_step(self, figures: StepFigures) -> dict:
        """Derive throughput, TFLOPS, MFU and memory; log, write and return the record."""
        self._check_open()
        tokens_per_s = (
            figures.tokens / figures.elapsed_s / self.world_size if figures.elapsed_s > 0 else 0.0
        )
        tflops = self.flops_per_token * tokens_per_s / 1e12
        mfu = 100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops else None
        memory = memory_stats(self.device)
        step_time_s = figures.elapsed_s / figures.steps_since_log if figures.steps_since_log > 0 else 0.0
        record = {
            "step": int(figures.step),
            "loss": float(figures.loss),
            # A skipped float16 step has no usable norm: null, not a non-standard NaN in the JSON.
            "grad_norm": None if figures.step_skipped else float(figures.grad_norm),
            "lr": float(figures.lr),
            "tokens": int(figures.tokens_seen),
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": mfu,
            "memory": memory,
            "time": time.time(),
            "step_time_s": step_time_s,
        }
        if figures.loss_scale is not None:
            record["loss_scale"] = float(figures.loss_scale["scale"])
            record["skipped_steps"] = int(figures.loss_scale["skipped_steps"])
            record["step_skipped"] = figures.step_skipped

        c = self.colors
        mem_gib = memory.get("max_reserved_gib", memory.get("peak_rss_gib", 0.0))
        parts = [
            f"{c.step}step {figures.step}{c.reset}",
            f"{c.loss}loss {figures.loss:.4f}{c.reset}",
            f"{c.grad}grad_norm {figures.grad_norm:.4f}{c.reset}",
            f"{c.lr}lr {figures.lr:.2e}{c.reset}",
            f"{c.tps}tps {tokens_per_s:,.0f}{c.reset}",
            f"{c.flops}tflops {tflops:.2f}{c.reset}",
        ]
        if mfu is not None:
            parts.append(f"{c.mfu}mfu {mfu:.2f}%{c.reset}")
        parts.append(f"{c.mem}mem {mem_gib:.2f}GiB{c.reset}")
        if figures.loss_scale is not None:
            parts.append(f"loss_scale {record['loss_scale']:g} (skipped {record['skipped_steps']})")
        logger.info("  ".join(parts))

        if self.is_log_rank:
            self._write(record)
        if self._writers:
            self._write_scalars(figures.step, _step_scalars(record))
        return record

    def _write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for writer in self._writers:
            writer.write(step, scalars)

    def log_scalars(self, step: int, values: dict[str, float], prefix: str) -> None:
        """Extra figures (e.g. validation loss): console line, a jsonl record with "kind": prefix
        and keys "<prefix>/<name>", and TensorBoard/W&B tags "<prefix>/<name>"."""
        self._check_open()
        c = self.colors
        body = "  ".join(f"{name} {_fmt(v if isinstance(v, int) else float(v))}" for name, v in values.items())
        logger.info("%s%s step %d%s  %s", c.step, prefix, step, c.reset, body)
        if self.is_log_rank:
            record: dict[str, Any] = {"step": int(step), "kind": prefix}
            record.update({f"{prefix}/{name}": v if isinstance(v, int) else float(v) for name, v in values.items()})
            record["time"] = time.time()
            self._write(record)
        self._write_scalars(step, {f"{prefix}/{name}": float(v) for name, v in values.items()})

    def close(self, failed: bool = False) -> None:
        """Close metrics.jsonl, TensorBoard and W&B (`failed`: marks the W&B run failed); calling
        it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close(failed)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
