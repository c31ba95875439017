"""Checkpoints: saving a run's state, publishing it, resuming from it, and reading it safely.

- manager.py: CheckpointManager, what a run saves and loads and when (resume, load_step,
  retention, save-on-signal); the one module the training loop talks to.
- items.py: what each item of a full checkpoint holds (model, optimizer, schedule, data position,
  TrainState), keyed by names that do not depend on the parallel layout.
- async_save.py: asynchronous saves, published the moment they are complete.
- on_disk.py: where checkpoints live and how complete ones are told from partial ones, torch-free
  for the preflight; step_folder.py: one step folder's record (checkpoint.json) and the errors.
- lineage.py: which trajectory a checkpoint belongs to (a resume never crosses to another).
- exports.py: the model-only and Hugging Face exports of a run's last save.
- seed.py: the step-0 seed checkpoint written by one process.
- Reading what another process or person wrote: checked_reader.py (DCP's reader, refusing a
  crafted or corrupt checkpoint), safe_unpickle.py (`.metadata` without running code),
  checksums.py (a flipped bit is refused, not loaded), dcp_read.py (a folder's keys and weights
  in one process, for the preflight and the Hugging Face converter).
"""
