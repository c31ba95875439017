"""job.save_config_file: the resolved configuration, written as TOML into the run's dump folder.

The dump folder is the run's own (one live job writes it), so the file is replaced at every
start, with the configuration of that start; but only a file this trainer wrote, recognized by
its first line. Anything else under that name is refused before launch rather than overwritten.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config.errors import ConfigError
from trainer.config.job_config import JobConfig
from trainer.config.manager import to_toml
from trainer.records.safe_writes import LinkRefused, write_atomic

HEADER = "# Resolved configuration of the run in this folder, written at each start (job.save_config_file)"


def saved_config_path(config: JobConfig) -> Path | None:
    name = config.job.save_config_file
    return None if name is None else Path(config.job.dump_folder) / name


def check_saved_config_file(config: JobConfig) -> None:
    """ConfigError when job.save_config_file names something this trainer did not write."""
    path = saved_config_path(config)
    if path is None or not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink():  # whatever it points at: the trainer writes none of its files through a link
        raise ConfigError(f"job.save_config_file: {path} is a symbolic link, which the trainer does not replace or "
                          "write through; remove it, or choose another name")
    if not path.is_file():
        raise ConfigError(f"job.save_config_file: {path} exists and is not a file; choose another name, such as "
                          "'config.toml'")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError as e:
        raise ConfigError(f"job.save_config_file: {path} cannot be read: {e.strerror}") from None
    if first != HEADER:
        raise ConfigError(f"job.save_config_file: {path} exists and was not written by this trainer (it does not "
                          "start with the line it writes), so it is not replaced; move it away, or choose another "
                          "name")


def write_config_file(config: JobConfig) -> Path | None:
    """Write the resolved configuration (what job.print_config prints) to job.save_config_file;
    rank 0 calls it. Written beside and renamed (trainer.records.safe_writes.write_atomic), so the file is
    never seen half written, and neither it nor the file beside it is written through a link."""
    path = saved_config_path(config)
    if path is None:
        return None
    check_saved_config_file(config)  # the preflight checked it too, but the folder may have changed since
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, f"{HEADER}\n{to_toml(config)}")
    except LinkRefused as e:  # a link put there since the check
        raise ConfigError(f"job.save_config_file: {e}") from None
    return path
