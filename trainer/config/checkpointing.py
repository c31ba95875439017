"""The [checkpoint] section: seed checkpoints, periodic saves, resume, exports.

Part of the job configuration (trainer/config/job_config.py), in its own module for size; like
it, every field's docstring is the reference, and nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.config.ranges import DType, valid
from trainer.launch.stop_request import DEFAULT_SIGNAL


@dataclass
class Checkpoint:
    """Distributed checkpoints (DCP): seed checkpoints, periodic saves, resume."""

    enable: bool = False
    """Save checkpoints and resume from the newest complete one in `folder`."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = valid(500, ge=1)
    """Save every this many steps (and at the last step)."""

    initial_load_path: str = ""
    """Checkpoint to start from when `folder` holds none (e.g. a seed checkpoint)."""

    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face checkpoint folder (config.json + safetensors), or a
    step folder whose hf/ holds the export of checkpoint.last_save_in_hf."""

    last_save_model_only: bool = True
    """The last save, a full checkpoint like every other, also writes the model weights alone (in
    export_dtype) to step-<N>/model_only/, after the checkpoint is published."""

    last_save_in_hf: bool = False
    """The last save, a full checkpoint like every other, also writes a Hugging Face export
    (config.json + safetensors, in export_dtype) to step-<N>/hf/, after the checkpoint is
    published."""

    export_dtype: DType = "float32"
    """Dtype of the last save's exports (model_only/, hf/)."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: training waits until the save is written. async: training waits only while the
    state is copied to fresh CPU memory; a background thread writes it and the checkpoint is
    published as soon as every rank's part is written. async_with_pinned_mem: as async, copying
    into CPU buffers kept for the whole run (pinned with CUDA; on CPU only reused). The last save
    is always synchronous (docs/checkpoints.md)."""

    keep_latest_k: int = valid(10, ge=0, note="0 keeps all")
    """Keep this many newest checkpoints; 0 keeps all."""

    load_step: int = valid(-1, ge=0, also=((-1, "the newest"),))
    """Resume from this step's checkpoint. -1: the newest complete one."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State to skip when resuming: any of model, optimizer, lr_scheduler, dataloader, train_state."""

    accept_data_change: bool = False
    """Resume even when the training data differs from the checkpoint's (another source, file
    content, tokenizer, sequence length or data seed; each change is named in the error without
    it): training goes on after the same number of sequences, read from this run's data."""

    accept_model_change: bool = False
    """Load trained weights into another model variant than the one they were trained as (a
    checkpoint of parallelism.tensor_parallel_sync per_block or grouped into another variant,
    group size or TP degree, or the reverse), and export such weights to Hugging Face (an exact
    Llama, which computes another function than the one trained). Refused without it."""

    verify_checksums: bool = True
    """Check every item a load reads, and `.metadata`, against the checksums the checkpoint
    recorded when it was saved (checksums.json): a flipped bit or a changed file is refused,
    naming the file and tensor. false loads a damaged checkpoint anyway (a checkpoint saved
    without checksums loads unchecked either way)."""

    create_seed_checkpoint: bool = False
    """Write a step-0 model-only checkpoint from one process and exit."""

    load_only: bool = False
    """Load checkpoints but never write any (comparison runs sharing a seed)."""

    overwrite: bool = False
    """Allow replacing existing checkpoints: a seed checkpoint, or the steps after
    checkpoint.load_step (a rewind: they are moved to <checkpoint folder>/previous/, and the run
    goes on as a new trajectory from load_step)."""

    enable_first_step_checkpoint: bool = False
    """Also save right after step 1."""

    save_on_signal: Literal["SIGUSR1", "SIGUSR2", "none"] = DEFAULT_SIGNAL
    """On this signal (to the launcher or a rank) every rank saves a checkpoint at a step they
    agree on, two steps after the first rank got it, and the run stops with exit code 75; the
    same command started again resumes onto the same curve. SLURM sends it before a job's time
    limit with `#SBATCH --signal=USR1@<seconds>`. Ignored (logged) by a run that saves no
    checkpoints; "none" ignores both signals."""
