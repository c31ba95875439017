"""The [metrics], [profiling] and [memory_estimation] sections: what a run records about itself
besides its checkpoints (console, metrics.jsonl, TensorBoard, W&B; profiler traces, memory
snapshots), and the memory it is estimated to need before it starts.

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.ranges import valid


@dataclass
class Metrics:
    """Console, metrics.jsonl and TensorBoard logging."""

    log_freq: int = valid(10, ge=1)
    """Log every this many steps (and step 1 and the last step)."""

    enable_tensorboard: bool = False
    """Write TensorBoard events under job.dump_folder/save_tb_folder."""

    enable_wandb: bool = False
    """Log the TensorBoard metrics (same tags and steps) to a Weights & Biases run whose config is
    the resolved job config, from the rank that logs (with save_for_all_ranks: one run per rank,
    named rank_<r>, in one group); needs the `wandb` package: .venv/bin/python -m pip install -e '.[wandb]'. The
    project is WANDB_PROJECT, else 'llama-pretrain'; the run's files go under job.dump_folder/wandb.
    WANDB_MODE=offline trains without an account or network (upload later with `wandb sync`);
    the other WANDB_* variables apply as usual. A failed run is marked failed."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder; each run gets a time-stamped subfolder."""

    disable_color_printing: bool = False
    """Plain console lines without ANSI colors (colors are only used when the output is a terminal,
    never in log files)."""

    save_for_all_ranks: bool = False
    """Every rank writes its own TensorBoard folder (default: only the rank that logs)."""

    count_collectives: bool = False
    """Count the collectives of the first step of each start (by mesh dimension, forward or
    backward, and operation, with the tensor-parallel syncs per forward pass): logged, written to
    metrics.jsonl (kind "collectives") and run_meta.json. The step runs under a dispatch mode that
    sees every operation, so it is slower; later steps are unaffected. Not with compile.enable."""

    fingerprints: bool = False
    """Record per-module fingerprints of chosen steps to job.dump_folder/fingerprints.jsonl: for
    every parameter (under its unsharded name) the norms of its gradient, its update and its
    value, and for every transformer block the RMS of its output and of the gradient flowing into
    it, each a global figure that means the same in every parallel layout (trainer/metrics/fingerprints.py).
    The convergence protocol compares them to say where two layouts part. Which steps:
    fingerprint_first and fingerprint_every."""

    fingerprint_first: int = valid(4, ge=0)
    """With fingerprints: record every step from 1 to this one (>= 0)."""

    fingerprint_every: int = valid(50, ge=0, note="0: only the first steps")
    """With fingerprints: after the first ones, record every this many steps (0: no more)."""

    peak_flops: float = valid(0.0, ge=0, note="0: looked up")
    """Peak FLOP/s of one device for MFU. 0: look the GPU up in the built-in table; on CPU MFU is omitted."""


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = False
    """Record a torch.profiler trace on every rank of the profiler_active steps that end at each
    multiple of profile_freq (CPU activity, and CUDA kernels on GPUs), written as Chrome-trace JSON
    to job.dump_folder/save_traces_folder/iteration_<step>/rank<r>_trace.json; open it in Perfetto
    (ui.perfetto.dev) or chrome://tracing. A window cut short by the end of training writes nothing."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: int = valid(10, ge=1)
    """Profile once every this many steps: traces end at steps profile_freq, 2 x profile_freq, ...
    (counted from step 0, also after a resume); memory snapshots are written at those steps. Must
    be >= profiler_warmup + profiler_active, so that one window ends before the next starts."""

    profiler_warmup: int = valid(3, ge=0)
    """Steps the profiler runs unrecorded before each recorded window (its start-up cost stays
    out of the trace); >= 0."""

    profiler_active: int = valid(1, ge=1)
    """Steps recorded in each trace, the last one a multiple of profile_freq; >= 1."""

    enable_memory_snapshot: bool = False
    """Record the CUDA caching allocator's history (its last 100,000 events, with stack traces) and
    write it every profile_freq steps to iteration_<step>/rank<r>_memory_snapshot.pickle under
    job.dump_folder/save_memory_snapshot_folder, and when a step runs out of memory to
    iteration_<step>_exit/; open it at https://pytorch.org/memory_viz. Needs CUDA devices:
    refused on the CPU."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""


@dataclass
class MemoryEstimation:
    """torchtitan's [memory_estimation]: the memory of every rank, estimated before training."""

    enable: bool = False
    """Before the ranks start, the launcher runs this trainer's estimator on the job at its world
    size (`python -m trainer.estimate --nproc N` with the same options: fake tensors and a fake
    process group, every layout) and prints what each rank holds, its step peak, whether it fits
    the device, and what the usual remedies would need. Training then starts whatever it found
    (`python -m trainer.estimate --strict` stops a job that does not fit)."""

    disable_fake_mode: bool = False
    """With `enable`: estimate on real tensors instead, in the job's own ranks (torchtitan's
    meaning). The launcher then starts the ranks at once; each builds its part of the model on its
    device, runs two steps of random tokens under the estimator's memory tracker, logs the
    tracker's peak beside the device allocator's (CUDA), frees it all and trains from the start,
    with the same data and weights as without it (trainer/estimate/real.py). It needs the memory
    the job needs; no effect without `enable`."""
