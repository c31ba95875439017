"""The exports of a run's last save (checkpoint.last_save_model_only: model_only/, the weights
alone in checkpoint.export_dtype; checkpoint.last_save_in_hf: hf/, the Hugging Face folder),
written into the final step-N once it is published, and settled at the next start when a run
stopped while writing them. Part of CheckpointManager (trainer/checkpoint/manager.py), which owns the
state these methods use."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.checksums import ChecksumWriter
from trainer.checkpoint.step_folder import (CheckpointWriteError, every_rank_of, is_write_failure, save_error_text,
                                      write_checkpoint_record)
from trainer.checkpoint.on_disk import (HF_EXPORT_DIR, MODEL_ONLY_DIR, complete_checkpoints, missing_exports,
                                      read_checkpoint_record)
from trainer.parallel.fsdp import DTYPES

logger = logging.getLogger("trainer.checkpoint.manager")


class LastSaveExports:
    """CheckpointManager's methods for the exports of the last save."""

    def _complete_exports(self, path: Path, step: int) -> str:
        """Write the exports the final checkpoint lacks (the run stopped while writing them);
        returns what to add to the message."""
        missing = missing_exports(path, self.config) if self.saves else []
        if not missing:
            return ""
        logger.info("%s: writing the exports the run stopped before writing: %s", path, ", ".join(missing))
        self._load(path, ["model"])
        self.last_saved = step
        self._write_exports(path, missing)
        return f" but its exports, written now ({', '.join(missing)})"

    def _settle_exports(self) -> None:
        """Exports the run stopped writing are removed (their checkpoint is whole: it was
        published before its exports were started); an export renamed into place whose
        checkpoint.json does not list it yet (the run stopped between the two) is complete, and
        is listed now: writing it again would find its folder in the way."""
        for path in self.folder.glob("step-*/.*.partial"):
            logger.warning("removing %s: an export that never completed (%s itself is complete; a run that finds it "
                           "final writes the missing exports again)", path, path.parent)
            shutil.rmtree(path, ignore_errors=True)
        for final in complete_checkpoints(self.folder).values():
            record = read_checkpoint_record(final)
            if record is None or record.get("kind") != "final":
                continue
            for name in (MODEL_ONLY_DIR, HF_EXPORT_DIR):
                if (final / name).is_dir() and name not in record.get("exports", []):
                    logger.info("%s: the export %s was complete when the run stopped; recorded now", final, name)
                    self._record_export(final, name)

    # ---- saving

    def _write_exports(self, final: Path, names: list[str]) -> None:
        """The exports of the last save, written after the full checkpoint is published: a crash
        here costs only the export. Each is written to a hidden folder beside its place and
        renamed into place when complete (the rename is its completion mark); a restart removes
        the unfinished ones and records the renamed ones (_settle_exports). A write that fails
        (a full disk) stops the run with one message (_export_failed)."""
        dtype = DTYPES[self.cfg.export_dtype]
        if MODEL_ONLY_DIR in names:
            folder = self._unfinished_export(final, MODEL_ONLY_DIR)
            try:
                dcp.save(self._stateful(["model"], export_dtype=dtype), storage_writer=ChecksumWriter(folder))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 (DCP raises it on every rank)
                self._export_failed(final, MODEL_ONLY_DIR, e)
            self._publish_export(final, MODEL_ONLY_DIR)
        if HF_EXPORT_DIR in names:
            name = self.external_weights.folder_name
            self._unfinished_export(final, name)
            dist.barrier()  # every rank's shard of the checkpoint is on disk
            if self.rank == 0:
                try:
                    self.external_weights.export(final, final / f".{name}.partial", dtype)
                except OSError as e:
                    self._export_failed(final, name, e)
            self._publish_export(final, name)

    def _unfinished_export(self, final: Path, name: str) -> Path:
        folder = final / f".{name}.partial"
        self._make_folder(folder, fresh=True)
        return folder

    def _publish_export(self, final: Path, name: str) -> None:
        """Rank 0, once every rank has written its part: rename the export into place and list it
        in checkpoint.json."""
        dist.barrier()
        if self.rank == 0:
            (final / f".{name}.partial").rename(final / name)
            self._record_export(final, name)
            logger.info("exported %s", final / name)
        dist.barrier()

    def _record_export(self, final: Path, name: str) -> None:
        record = read_checkpoint_record(final) or self._record(self.last_saved, "final")
        exports = [*(e for e in record.get("exports", []) if e != name), name]
        write_checkpoint_record(final, {**record, "exports": exports, "export_dtype": self.cfg.export_dtype})

    def _export_failed(self, final: Path, name: str, error: BaseException) -> None:
        """An export of the last save that could not be written: stop with one message. The
        checkpoint is complete and published; the next start writes the missing export. (A peer
        that died meanwhile is the run's failure as it is: the launcher restarts it.)"""
        if not is_write_failure(error):
            raise error
        text = save_error_text(error, final)
        with every_rank_of(error):  # each rank has looked at the disk, then waits for the space freed here
            if self.rank == 0:
                shutil.rmtree(final / f".{name}.partial", ignore_errors=True)  # its part-written files take space
        raise CheckpointWriteError(
            f"the {name} export of {final} could not be written: {text}. {final} itself is complete; once the "
            "problem is fixed, starting the same command again writes the export (nothing is trained again)"
        ) from error
