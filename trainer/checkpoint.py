"""Distributed checkpoints (DCP): save, resume, seed checkpoints, retention.

Layout: <job.dump_folder>/<checkpoint.folder>/step-<N>/ holds one DCP checkpoint with the items
model, optimizer, lr_scheduler, dataloader, train_state, and checkpoint.json (what saved it). Every
save is full, the last one included, so raising training.steps continues a finished run exactly;
checkpoint.last_save_model_only adds the weights alone, in export_dtype, under
step-<N>/model_only/. Seed checkpoints (step-0) hold only the model. A save is written to
.step-<N>.partial/ and renamed to step-<N>/ as soon as every rank has finished (an asynchronous
save too: see trainer/async_checkpoint.py), so a run killed while saving leaves nothing that looks
like a checkpoint. At the next start, a partial folder whose save had finished (readable .metadata,
every data file whole) is published; the others are removed. DCP reshards on load: a checkpoint
saved at one layout loads into any other.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint_layout import (
    CHECKPOINT_RECORD,
    HF_EXPORT_DIR,
    MODEL_ONLY_DIR,
    complete_checkpoints,
    finished_partials,
    fingerprint,
    check_step_folders,
    initial_load_folder,
    named_step,
    partial_path,
    read_checkpoint_record,
)
from trainer.async_checkpoint import AsyncSaver
from trainer.checkpoint_items import (ModelState, OptimizerState, SchedulerState, aliased_names,
                                      optimizer_state_is_nested)
from trainer.config.manager import to_dict
from trainer.dcp_files import incomplete_reason, saved_items, saved_keys
from trainer.optim import schedule_change, set_schedule_position
from trainer.parallel.fsdp import DTYPES
from trainer.train_state import TrainState
from trainer.version import code_version

logger = logging.getLogger(__name__)

ITEMS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


class CheckpointError(ValueError):
    """A checkpoint a user named or pointed at cannot be used; the message names it."""


class TrainingComplete(Exception):
    """The checkpoint folder already holds the final checkpoint of this run."""


# ---------------------------------------------------------------------------------------------
# Inspecting folders


def check_model_shapes(path: Path, model: torch.nn.Module, flavor: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first parameter that differs."""
    keys = saved_keys(path)
    aliases = aliased_names(model)
    for name, param in model.state_dict().items():
        if name in aliases:  # a tied weight is saved once, under its parameter name
            if f"model.{name}" in keys:
                raise CheckpointError(
                    f"{path}: has a separate {name} (an untied output layer) but this model ({flavor}) ties it to "
                    f"{aliases[name]}; load it into a model with an untied output (e.g. a flavor without tied "
                    "embeddings, or model.flavor = \"hf\" with tie_word_embeddings = false)")
            continue
        saved = keys.get(f"model.{name}")
        if f"model.{name}" not in keys:
            raise CheckpointError(f"{path}: has no parameter {name}; it is not a checkpoint of this model ({flavor})")
        if saved != tuple(param.shape):
            raise CheckpointError(f"{path}: parameter {name} has shape {list(saved)} in the checkpoint but "
                                  f"{list(param.shape)} in this model ({flavor}); it belongs to another model")


# ---------------------------------------------------------------------------------------------
# The manager


def is_resumable(path: Path) -> bool:
    """A checkpoint holding the training state (a full save), not only model weights."""
    record = read_checkpoint_record(path)
    if record is not None and "items" in record:
        return "train_state" in record["items"]
    return "train_state" in saved_items(saved_keys(path))


def checkpoint_record(config, step: int, items: list[str], kind: str, **extra) -> dict:
    """The content of checkpoint.json: what saved this checkpoint, and with which configuration."""
    return {"step": step, "items": items, "kind": kind, **extra, "config": to_dict(config), "code": code_version(),
            "torch": torch.__version__, "saved": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_checkpoint_record(folder: Path, record: dict) -> None:
    (folder / CHECKPOINT_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")


class CheckpointManager:
    """Decides what to load at start and when to save, following the [checkpoint] section."""

    def __init__(self, config, *, model, optimizer, scheduler, loader, train_state: TrainState, rank: int,
                 external_weights=None):
        """`external_weights` reads and writes the model's weights in another format (an object
        with load(path) and export(checkpoint, out, dtype), and folder_name): used for
        checkpoint.initial_load_in_hf and checkpoint.last_save_in_hf (trainer.hf.model_io)."""
        self.config = config
        self.cfg = config.checkpoint
        self.flavor = config.model.flavor
        self.total_steps = config.training.steps
        self.folder = Path(config.job.dump_folder) / self.cfg.folder
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.train_state = train_state
        self.rank = rank
        self.external_weights = external_weights
        self.last_saved: int | None = None  # step of this run's latest save
        # What resume() loaded, for the run record: kind init | checkpoint | resume | hugging_face.
        self.start = {"kind": "init", "path": None, "step": 0, "fingerprint": None}
        self.async_saver = (AsyncSaver(self.cfg.async_mode, rank, self._publish_async)
                            if self.cfg.async_mode != "disabled" else None)

    def _stateful(self, items, *, export_dtype: torch.dtype | None = None, nested_optimizer: bool = False) -> dict:
        objects = {
            "model": lambda: ModelState(self.model, export_dtype),
            "optimizer": lambda: OptimizerState(self.model, self.optimizer, flattened=not nested_optimizer),
            "lr_scheduler": lambda: SchedulerState(self.scheduler),
            "dataloader": lambda: self.loader,
            "train_state": lambda: self.train_state,
        }
        return {item: objects[item]() for item in items}

    # ---- loading

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the folder (or checkpoint.load_step), else the
        initial_load_path; returns what was loaded. Raises CheckpointError when the folder holds
        checkpoints this run cannot continue from, TrainingComplete when it is finished."""
        if self.cfg.enable:
            try:
                check_step_folders(self.folder)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        if self.saves:  # every rank must see the same folder below
            if self.rank == 0:
                self._publish_finished_partials()
            dist.barrier()
        found = complete_checkpoints(self.folder) if self.cfg.enable else {}
        items = list(ITEMS)
        if self.cfg.enable and self.cfg.load_step != -1:
            path = self._named_step(found, self.cfg.load_step)
            newer = [s for s in found if s > self.cfg.load_step]
            if newer and not self.cfg.load_only and not self.cfg.overwrite:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step}: {self.folder} holds newer checkpoints "
                    f"({', '.join(f'step-{s}' for s in newer)}) that this run would overwrite; use another "
                    "checkpoint.folder, --checkpoint.load_only, or --checkpoint.overwrite")
        elif found:
            path = self._resume_point(found)
        elif self.cfg.initial_load_path:
            named = Path(self.cfg.initial_load_path)
            try:
                path = initial_load_folder(named, self.cfg.initial_load_in_hf, self.cfg.initial_load_model_only)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            if path != named:
                logger.info("checkpoint.initial_load_path %s: reading its Hugging Face export %s", named, path)
            if self.cfg.initial_load_in_hf:
                self._load_external(path)
                self.start = {"kind": "hugging_face", "path": str(path.resolve()), "step": 0,
                              "fingerprint": fingerprint(path)}
                return path
            items = ["model"] if self.cfg.initial_load_model_only else items
        else:
            path = None
        if self.rank == 0 and self.cfg.enable and not self.cfg.load_only:
            self._remove_stale_partials()
        return self._load(path, items) if path is not None else None

    def _resume_point(self, found: dict[int, Path]) -> Path:
        """The newest checkpoint of the folder, when this run can continue from it: a full one
        before training.steps, or the step-0 seed."""
        newest = max(found)
        path = found[newest]
        if newest == 0:
            return path
        if newest >= self.total_steps:
            if newest > self.total_steps and is_resumable(path):
                raise CheckpointError(
                    f"{path} is past training.steps = {self.total_steps}: this run went further already. Raise "
                    f"training.steps above {newest} to continue it, resume an earlier step with "
                    "--checkpoint.load_step S --checkpoint.overwrite, or use another job.dump_folder")
            raise TrainingComplete(f"{path} is the final checkpoint of this run (training.steps = "
                                   f"{self.total_steps}); nothing to do. Raise training.steps to continue.")
        if is_resumable(path):
            return path
        # Only earlier versions of this trainer wrote a model-only last save.
        full = [s for s, p in found.items() if s and is_resumable(p)]
        options = [f"start a new run from its weights with --checkpoint.initial_load_path {path} "
                   "--job.dump_folder NEW_FOLDER"]
        if full:
            options.insert(0, f"continue from step-{full[-1]}, the newest full checkpoint, with --checkpoint.load_step "
                              f"{full[-1]} --checkpoint.overwrite (steps {full[-1] + 1}-{newest} are trained again)")
        raise CheckpointError(
            f"{path} holds the model weights only (a final export): without its optimizer state and data position "
            f"this run cannot continue from step {newest} exactly. Either " + ", or ".join(options))

    def _named_step(self, found: dict[int, Path], step: int) -> Path:
        try:
            return named_step(self.folder, found, step)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def _load(self, path: Path, wanted: list[str]) -> Path:
        check_model_shapes(path, self.model, self.flavor)
        keys = saved_keys(path)
        present = saved_items(keys)
        items = [i for i in wanted if i in present and i not in self.cfg.exclude_from_loading]
        missing = [i for i in wanted if i not in present and i != "model"]
        if missing and "train_state" in present:
            logger.warning("%s has no %s; starting those fresh", path, ", ".join(missing))
        if "dataloader" in items:
            self.loader.expect_saved_keys({key.split(".", 1)[1] for key in keys if key.startswith("dataloader.")})
        dcp.load(self._stateful(items, nested_optimizer=optimizer_state_is_nested(keys)), checkpoint_id=str(path))
        if "lr_scheduler" in items:
            self._continue_schedule(path)
        kind = "resume" if "train_state" in items else "checkpoint"
        self.start = {"kind": kind, "path": str(path.resolve()), "step": self.train_state.step,
                      "fingerprint": fingerprint(path)}
        logger.info("loaded %s from %s (step %d)", ", ".join(items), path, self.train_state.step)
        return path

    def _continue_schedule(self, path: Path) -> None:
        """The loaded optimizer holds the learning rate the saving run computed for the next step;
        recompute it from this run's schedule (training.steps may have been raised), and say when
        the steps already trained followed a different schedule."""
        set_schedule_position(self.scheduler, self.scheduler.last_epoch)
        record = read_checkpoint_record(path)
        if record is None:
            return
        changed = schedule_change(record["config"], self.config, self.train_state.step)
        if changed:
            logger.warning("%s: %s", path, changed)

    def _load_external(self, path: Path) -> None:
        """Weights from a folder in the external format (Hugging Face)."""
        try:
            self.external_weights.load(path)
        except ValueError as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {e}") from None

    def _export_external(self, checkpoint: Path, dtype: torch.dtype) -> str:
        """Rank 0 converts the model of a just-written checkpoint into checkpoint/<folder_name>."""
        dist.barrier()  # every rank's shard is on disk
        name = self.external_weights.folder_name
        if self.rank == 0:
            self.external_weights.export(checkpoint, checkpoint / name, dtype)
        return name

    def _publish_finished_partials(self) -> None:
        """Publish the saves the last run finished writing but stopped before renaming (an
        asynchronous save completes in the background; a crash can come before its rename).
        Retention waits for the next save: this run may resume from an older load_step."""
        for step, partial in finished_partials(self.folder).items():
            problem = incomplete_reason(partial)
            if problem is None and read_checkpoint_record(partial) is None:
                if any((partial / sub).exists() for sub in (MODEL_ONLY_DIR, HF_EXPORT_DIR)):
                    problem = "its exports were being written when the run stopped"
                else:  # written by an earlier version of this trainer, which wrote the record last
                    write_checkpoint_record(partial, checkpoint_record(
                        self.config, step, sorted(saved_items(saved_keys(partial))), "periodic", exports=[],
                        published_at_restart=True))
            if problem is not None:
                logger.warning("%s is not a complete save: %s", partial, problem)
                continue  # removed by _remove_stale_partials
            logger.info("publishing %s: its save had completed before the run stopped", partial)
            self._rename_into_place(step, partial)

    def _remove_stale_partials(self) -> None:
        if not self.folder.is_dir():
            return
        for path in self.folder.glob(".step-*.partial"):
            logger.warning("removing %s: a save that never completed", path)
            shutil.rmtree(path, ignore_errors=True)

    # ---- saving

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints at all."""
        return self.cfg.enable and not self.cfg.load_only

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.saves:
            return False
        return (step % self.cfg.interval == 0 or step == last_step
                or (step == 1 and self.cfg.enable_first_step_checkpoint))

    def save(self, step: int, *, last: bool = False) -> None:
        """Write step-<step>, a full checkpoint. The last save also writes the exports it is
        configured for: model_only/ (the weights in export_dtype) and hf/."""
        started = time.perf_counter()
        self._save(step, last)
        how = "the last save, synchronous" if last else f"async_mode {self.cfg.async_mode}"
        logger.info("checkpoint step-%d: training paused %.3f s to save (%s)", step, time.perf_counter() - started, how)

    def _save(self, step: int, last: bool) -> None:
        self.wait()  # the save before: its files, and the staging buffers it may reuse
        self.last_saved = step
        final, partial = self.folder / f"step-{step}", partial_path(self.folder, step)
        refuse_overwrite(final, self.cfg.overwrite)
        self._make_folder(partial, fresh=True)
        state = self._stateful(ITEMS)
        if self.async_saver is not None and not last:
            if self.rank == 0:  # first, so that a save found complete after a crash has its record
                write_checkpoint_record(partial, checkpoint_record(self.config, step, list(ITEMS), "periodic",
                                                                   exports=[], export_dtype=None))
            self.async_saver.start(state, step, partial)
            return
        dcp.save(state, checkpoint_id=str(partial))
        exports = []
        if last and self.cfg.last_save_model_only:
            export_dtype = DTYPES[self.cfg.export_dtype]
            self._make_folder(partial / MODEL_ONLY_DIR, fresh=False)
            dcp.save(self._stateful(["model"], export_dtype=export_dtype), checkpoint_id=str(partial / MODEL_ONLY_DIR))
            exports.append(MODEL_ONLY_DIR)
        if last and self.cfg.last_save_in_hf:  # inside the folder, so it is published with it
            exports.append(self._export_external(partial, DTYPES[self.cfg.export_dtype]))
        self._finish(step, partial, kind="final" if last else "periodic", exports=exports)

    def _make_folder(self, path: Path, fresh: bool) -> None:
        """Rank 0 creates the folder (emptied first when `fresh`); every rank waits for it."""
        if self.rank == 0:
            if fresh:
                shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=not fresh)
        dist.barrier()

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, to be written and published (rank 0
        publishes it from the writer's thread as soon as it is complete; see AsyncSaver)."""
        if self.async_saver is not None:
            self.async_saver.wait()

    def background_groups(self) -> tuple:
        """The process groups of background saves. They wait for every rank's file writes, which
        a slow disk can stretch past the training timeout: they keep the init timeout."""
        return (self.async_saver.group,) if self.async_saver is not None else ()

    def _publish_async(self, step: int, partial: Path) -> None:
        """Rank 0, on the writer's thread, once DCP wrote .metadata (after every rank's data)."""
        self._rename_into_place(step, partial)
        self._apply_retention()

    def _finish(self, step: int, partial: Path, kind: str, exports: list[str]) -> None:
        """Publish a fully written checkpoint under its final name, then apply keep_latest_k."""
        dist.barrier()
        if self.rank == 0:
            write_checkpoint_record(partial, checkpoint_record(
                self.config, step, list(ITEMS), kind, exports=exports,
                export_dtype=self.cfg.export_dtype if exports else None))
            self._rename_into_place(step, partial)
            self._apply_retention()
        dist.barrier()

    def _rename_into_place(self, step: int, partial: Path) -> None:
        """Rank 0: publish a complete save under its final name."""
        final = self.folder / f"step-{step}"
        if final.exists():  # only reachable with checkpoint.overwrite: the partial is the newer save
            shutil.rmtree(final)
        partial.rename(final)
        logger.info("saved checkpoint %s", final)

    def _apply_retention(self) -> None:
        """Keep the newest keep_latest_k checkpoints, and always the newest full one (the point
        this run resumes from) and the step-0 seed."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        found = complete_checkpoints(self.folder)
        steps = [s for s in found if s != 0]
        full = [s for s in steps if is_resumable(found[s])]
        keep = set(steps[-k:]) | set(full[-1:])
        for step in steps:
            if step not in keep:
                shutil.rmtree(found[step])
                logger.info("removed checkpoint step-%d (keep_latest_k=%d)", step, k)


def refuse_overwrite(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists already; refusing to overwrite it (use --checkpoint.overwrite)")


def save_seed_checkpoint(model: torch.nn.Module, folder: Path, overwrite: bool, record: dict | None = None) -> Path:
    """A step-0, model-only checkpoint written by a single process; `record` goes to its
    checkpoint.json (see checkpoint_record)."""
    final = folder / "step-0"
    refuse_overwrite(final, overwrite)
    partial = partial_path(folder, 0)
    shutil.rmtree(partial, ignore_errors=True)
    with warnings.catch_warnings():  # DCP notes that it saves without a process group: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": ModelState(model)}, checkpoint_id=str(partial), no_dist=True)
    if record is not None:
        write_checkpoint_record(partial, record)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return final
