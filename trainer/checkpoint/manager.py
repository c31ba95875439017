"""Distributed checkpoints (DCP): save, resume, seed checkpoints, retention.

Layout: <job.dump_folder>/<checkpoint.folder>/step-<N>/ holds one DCP checkpoint with the items
model, optimizer, lr_scheduler, dataloader, train_state, and checkpoint.json (what saved it). Every
save is full, the last one included, so raising training.steps continues a finished run exactly;
checkpoint.last_save_model_only adds the weights alone, in export_dtype, under
step-<N>/model_only/. Seed checkpoints (step-0) hold only the model. A save is written to
.step-<N>.partial/ and renamed to step-<N>/ as soon as every rank has finished (an asynchronous
save too: see trainer/checkpoint/async_save.py), so a run killed while saving leaves nothing that looks
like a checkpoint. At the next start, a partial folder whose save had finished (readable .metadata,
every data file whole) is published; the others are removed. DCP reshards on load: a checkpoint
saved at one layout loads into any other.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.async_save import AsyncSaver
from trainer.checkpoint.exports import LastSaveExports
from trainer.checkpoint.step_folder import (  # noqa: F401 (the errors and seed checkpoints are used from here)
    CheckpointError,
    CheckpointWriteError,
    TrainingComplete,
    check_model_shapes,
    checkpoint_record,
    is_resumable,
    is_write_failure,
    refuse_overwrite,
    save_error_text,
    every_rank_of,
    save_seed_checkpoint,
    write_checkpoint_record,
)
from trainer.checkpoint.checksums import ChecksumWriter
from trainer.checkpoint.items import ModelState, OptimizerState, SchedulerState, optimizer_state_is_nested
from trainer.checkpoint.on_disk import (
    HF_EXPORT_DIR,
    MODEL_ONLY_DIR,
    check_step_folders,
    complete_checkpoints,
    complete_message,
    finished_partials,
    fingerprint,
    initial_load_folder,
    missing_exports,
    named_step,
    partial_path,
    past_steps_message,
    read_checkpoint_record,
    discard,
    remove_checkpoint,
)
from trainer.checkpoint.lineage import (foreign_checkpoint, forked_ancestors, lineage_of, model_change,
                                        move_newer_aside, new_lineage, read_head, write_head)
from trainer.config.manager import to_dict
from trainer.checkpoint.dcp_read import incomplete_reason, saved_items, saved_keys
from trainer.checkpoint.checked_reader import CheckedReader, UnsafeCheckpointError
from trainer.optim import schedule_change, set_schedule_position, settings_changed
from trainer.checkpoint.items import TrainState

logger = logging.getLogger(__name__)

ITEMS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


class CheckpointManager(LastSaveExports):
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
        # The trajectory this run continues (trainer/checkpoint/lineage.py): set by resume(), and
        # `parent` moves to each checkpoint this run publishes.
        self.lineage: str = new_lineage()
        self.ancestors: list[dict] = []
        self.parent: dict | None = None
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
                self._settle_exports()
            dist.barrier()
        found = complete_checkpoints(self.folder) if self.cfg.enable else {}
        items = list(ITEMS)
        branch = False  # loading an older step than the folder's newest
        if self.cfg.enable and self.cfg.load_step != -1:
            path = self._named_step(found, self.cfg.load_step)
            self._refuse_foreign(path)
            newer = [s for s in found if s > self.cfg.load_step]
            if newer and not self.cfg.load_only and not self.cfg.overwrite:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step}: {self.folder} holds newer checkpoints "
                    f"({', '.join(f'step-{s}' for s in newer)}) that this run would overwrite; use another "
                    "checkpoint.folder, --checkpoint.load_only, or --checkpoint.overwrite")
            branch = bool(newer)
        elif found:
            path = self._resume_point(found)
            self._refuse_foreign(path)
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
        if path is None:
            return None
        self._load(path, items)
        self._continue_lineage(path, found, branch)
        return path

    def _refuse_foreign(self, path: Path) -> None:
        """A checkpoint of this folder from another trajectory than its newest saves (the seed
        begins every trajectory)."""
        foreign = foreign_checkpoint(self.folder, path) if path.name != "step-0" else None
        if foreign:
            raise CheckpointError(foreign)

    @property
    def trajectory(self) -> dict:
        """The training trajectory this run's steps belong to (for its record, trainer/records/run_meta.py)."""
        return {"lineage": self.lineage, "ancestors": self.ancestors}

    def _continue_lineage(self, path: Path, found: dict[int, Path], branch: bool) -> None:
        """The lineage and parent of this run's saves, once `path` is loaded. A checkpoint of this
        folder continues its lineage. A branch (an older step than the folder's newest) starts a
        new one from `path`, as does any other start; a run that saves moves the newer
        checkpoints aside (a rewind), one that does not leaves them (its steps are its own
        trajectory, which the folder's checkpoints do not continue)."""
        rewind = branch and self.saves
        in_folder = path.parent.resolve() == self.folder.resolve() and path.name != "step-0"
        self.parent = {"step": self.train_state.step, "path": str(path.resolve()), "fingerprint": fingerprint(path)}
        head = read_head(self.folder) if in_folder else None
        if branch:
            self.ancestors = forked_ancestors(head, path, self.train_state.step)
        elif head is not None:  # on the head's trajectory (checked): continue it
            self.lineage, self.ancestors = head["lineage"], head.get("ancestors", [])
        elif in_folder:  # a folder of an earlier version: continue the checkpoint's own lineage
            self.lineage = lineage_of(path) or self.lineage
        if rewind and self.rank == 0:
            moved = move_newer_aside(self.folder, found, self.cfg.load_step)
            logger.warning("rewound to step-%d: the checkpoints after it moved to %s; this run goes on as a new "
                           "trajectory (lineage %s)", self.cfg.load_step, moved, self.lineage)
        if self.saves and self.rank == 0:
            write_head(self.folder, self.lineage, self.train_state.step, self.ancestors)
        if rewind:
            dist.barrier()  # every rank sees the folder without the abandoned checkpoints

    def _resume_point(self, found: dict[int, Path]) -> Path:
        """The newest checkpoint of the folder, when this run can continue from it: a full one
        before training.steps, or the step-0 seed."""
        newest = max(found)
        path = found[newest]
        if newest == 0:
            return path
        if newest >= self.total_steps:
            if newest > self.total_steps and is_resumable(path):
                raise CheckpointError(past_steps_message(path, newest, self.total_steps))
            written = self._complete_exports(path, newest)
            raise TrainingComplete(complete_message(path, self.total_steps, written), wrote_exports=bool(written))
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
        """Load `wanted` items from `path`; a file that would run code refuses the checkpoint."""
        try:
            return self._load_items(path, wanted)
        except UnsafeCheckpointError as e:
            raise CheckpointError(str(e)) from None
        except CheckpointException as e:  # DCP wraps what failed on each rank
            failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            unsafe = [f for f in failures if isinstance(f, UnsafeCheckpointError)]
            if unsafe:
                raise CheckpointError(str(unsafe[0])) from None
            raise

    def _load_items(self, path: Path, wanted: list[str]) -> Path:
        check_model_shapes(path, self.model, self.flavor)
        change = model_change(path, to_dict(self.config)["parallelism"])
        if change and not self.cfg.accept_model_change:
            raise CheckpointError(change)
        if change:
            logger.warning("%s (checkpoint.accept_model_change)", change.split(". Set --checkpoint")[0])
        keys = saved_keys(path)
        present = saved_items(keys)
        items = [i for i in wanted if i in present and i not in self.cfg.exclude_from_loading]
        missing = [i for i in wanted if i not in present and i != "model"]
        if missing and "train_state" in present:
            logger.warning("%s has no %s; starting those fresh", path, ", ".join(missing))
        if "dataloader" in items:
            self.loader.expect_saved_keys({key.split(".", 1)[1] for key in keys if key.startswith("dataloader.")})
        state = self._stateful(items, nested_optimizer=optimizer_state_is_nested(keys))
        if not self.cfg.verify_checksums:
            logger.warning("loading %s without checking its checksums (checkpoint.verify_checksums = false): a damaged "
                           "file loads as wrong values", path)
        dcp.load(state, storage_reader=CheckedReader(path, self.cfg.verify_checksums))  # admits no code from the files (trainer/checkpoint/checked_reader.py)
        if "lr_scheduler" in items:
            self._continue_schedule(path)
        kind = "resume" if "train_state" in items else "checkpoint"
        self.start = {"kind": kind, "path": str(path.resolve()), "step": self.train_state.step,
                      "fingerprint": fingerprint(path)}
        if "optimizer" in items:
            self.start["changed"] = self._say_changed_settings(path, state)
        logger.info("loaded %s from %s (step %d)", ", ".join(items), path, self.train_state.step)
        return path

    def _say_changed_settings(self, path: Path, state: dict) -> list[str]:
        """The optimizer and schedule settings that differ from the checkpoint's, in one line: the
        configured ones apply from the next step (OptimizerState, SchedulerState), and the run's
        record lists them (start.changed). Told from the checkpoint's record, or, for checkpoints
        of earlier versions without one, from the settings its state held."""
        record = read_checkpoint_record(path)
        if record is not None and "config" in record:
            changed = settings_changed(record["config"], self.config)
        else:
            changed = [f"optimizer (param_groups) {key}" for key in sorted(state["optimizer"].changed)]
            scheduler = state.get("lr_scheduler")
            if scheduler is not None and scheduler.saved_peak not in (None, self.config.optimizer.lr):
                changed.append(f"optimizer.lr {scheduler.saved_peak!r} -> {self.config.optimizer.lr!r}")
        if changed:
            logger.warning("%s was saved with other settings; this run's apply from step %d on (steps 1-%d were "
                           "trained with the checkpoint's): %s", path, self.train_state.step + 1,
                           self.train_state.step, "; ".join(changed))
        return changed

    def _continue_schedule(self, path: Path) -> None:
        """The loaded optimizer holds the learning rate the saving run computed for the next step;
        recompute it from this run's schedule (training.steps may have been raised), and say when
        the steps already trained followed a different schedule."""
        set_schedule_position(self.scheduler, self.scheduler.last_epoch)
        record = read_checkpoint_record(path)
        if record is None or "config" not in record:
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

    def _publish_finished_partials(self) -> None:
        """Publish the saves the last run finished writing but stopped before renaming (an
        asynchronous save completes in the background; a crash can come before its rename).
        Retention waits for the next save: this run may resume from an older load_step."""
        for step, partial in finished_partials(self.folder).items():
            problem = incomplete_reason(partial)
            if problem is None and read_checkpoint_record(partial) is None:
                # Written by an earlier version of this trainer, which wrote the record last, after
                # the exports: the checkpoint is whole, exports found in it may not be.
                for export in (MODEL_ONLY_DIR, HF_EXPORT_DIR):
                    if (partial / export).exists():
                        logger.warning("removing %s: an export the run stopped writing", partial / export)
                        shutil.rmtree(partial / export)
                write_checkpoint_record(partial, checkpoint_record(
                    self.config, step, sorted(saved_items(saved_keys(partial))), "periodic", exports=[],
                    published_at_restart=True))
            if problem is not None:
                logger.warning("%s is not a complete save: %s", partial, problem)
                continue  # removed by _remove_stale_partials
            logger.info("publishing %s: its save had completed before the run stopped", partial)
            self._publish(step, partial)

    def _remove_stale_partials(self) -> None:
        if not self.folder.is_dir():
            return
        for path in self.folder.glob(".step-*.partial"):
            logger.warning("removing %s: a save that never completed", path)
            shutil.rmtree(path, ignore_errors=True)
        for path in self.folder.glob(".step-*.removing"):  # a removal that was interrupted
            discard(path)


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
        kind = "final" if last else "periodic"
        if self.rank == 0:  # first, so that a save found complete after a crash has its record
            try:
                write_checkpoint_record(partial, self._record(step, kind))
            except OSError as e:
                self._save_failed(step, partial, e)
        if self.async_saver is not None and not last:
            self.async_saver.start(state, step, partial)
            return
        try:
            dcp.save(state, storage_writer=ChecksumWriter(partial))  # with checksums.json
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (DCP raises it on every rank)
            self._save_failed(step, partial, e)
        self._publish_sync(step, partial)
        if last:
            self._write_exports(final, missing_exports(final, self.config))

    def _record(self, step: int, kind: str, **extra) -> dict:
        return checkpoint_record(self.config, step, list(ITEMS), kind, lineage=self.lineage, parent=self.parent,
                                 **extra)

    def _save_failed(self, step: int, partial: Path, error: BaseException) -> None:
        """A save that could not be written (a full disk, a quota, a file-size limit, a folder
        that became read-only, on any rank): stop the run with one message; the checkpoints before
        it are untouched. (A peer that died meanwhile is the run's failure as it is: the launcher
        restarts it, and the next start removes the unfinished save.)"""
        if not is_write_failure(error):
            raise error
        text = save_error_text(error, partial.parent)  # before its files are removed: is the disk full?
        with every_rank_of(error):  # each rank has looked at the disk, then waits for the space freed here
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # its part-written files take space
        found = [s for s in complete_checkpoints(self.folder) if s < step]
        kept = (f"step-{found[-1]}, the newest complete checkpoint, is intact: the run resumes from it once the "
                "problem is fixed" if found else "no earlier checkpoint of this run exists")
        raise CheckpointWriteError(f"checkpoint step-{step} could not be written to {partial.parent}: "
                                   f"{text}. Nothing older was removed; {kept}") from error


    def _make_folder(self, path: Path, fresh: bool) -> None:
        """Rank 0 creates the folder (emptied first when `fresh`); every rank waits for it. A
        folder that cannot be created (read-only, full, no permission) stops the run with one
        message, which a restart would not change."""
        if self.rank == 0:
            try:
                if fresh:
                    shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True, exist_ok=not fresh)
            except OSError as e:
                raise CheckpointWriteError(f"{path} cannot be created: {save_error_text(e, path.parent)}; the "
                                           "checkpoint folder must be writable") from None
        dist.barrier()

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, to be written and published (rank 0
        publishes it from the writer's thread as soon as it is complete; see AsyncSaver)."""
        if self.async_saver is None or self.async_saver.pending is None:
            return
        step = self.async_saver.pending.step
        try:
            self.async_saver.wait()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (a background write that failed)
            self._save_failed(step, partial_path(self.folder, step), e)

    def background_groups(self) -> tuple:
        """The process groups of background saves. They wait for every rank's file writes, which
        a slow disk can stretch past the training timeout: they keep the init timeout."""
        return (self.async_saver.group,) if self.async_saver is not None else ()

    def _publish_async(self, step: int, partial: Path) -> None:
        """Rank 0, on the writer's thread, once DCP wrote .metadata (after every rank's data)."""
        self._publish(step, partial)
        self._apply_retention()

    def _publish_sync(self, step: int, partial: Path) -> None:
        """Every rank, after a synchronous save: rank 0 publishes the checkpoint, then applies keep_latest_k."""
        dist.barrier()
        if self.rank == 0:
            try:
                self._publish(step, partial)
            except OSError as e:  # lineage.json on a disk that filled up meanwhile: the checkpoint is whole
                raise CheckpointWriteError(f"{self.folder / f'step-{step}'} was saved, but the checkpoint folder's "
                                           f"record could not be written: {save_error_text(e, self.folder)}") from None
            self._apply_retention()
        dist.barrier()

    def _publish(self, step: int, partial: Path) -> None:
        """Rank 0: publish a complete save, renaming its .step-N.partial folder to step-N (the
        only place a checkpoint gets its final name); it becomes the parent of the
        next save and the head of the folder's lineage."""
        final = self.folder / f"step-{step}"
        if final.exists() or final.is_symlink():  # only with checkpoint.overwrite: the partial is the newer save
            remove_checkpoint(final)
        partial.rename(final)
        self.parent = {"step": step, "path": str(final.resolve()), "fingerprint": fingerprint(final)}
        write_head(self.folder, self.lineage, step, self.ancestors)
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
                remove_checkpoint(found[step])
                logger.info("removed checkpoint step-%d (keep_latest_k=%d)", step, k)
