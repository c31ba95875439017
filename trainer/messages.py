"""How every command prints its messages, and the warnings a run keeps.

One format for every command (the launcher, the trainer, also under --job.print_config and
--help, preflight, estimate, hf, data and protocol): an error reads `error: ...`, a warning
`warning: ...`, each printed once per process; other messages are printed as they are. A training
rank's log puts the time first (`12:00:01 warning: ...`).

Every warning of the trainer's and the protocol's loggers is also kept (`kept_warnings`): the
launcher writes them into its launcher.log and the rank that logs into run_meta.json
(`warnings`), so a finished run records what it was told, e.g. that options it was given were
ignored. A warning another process has printed already (the launcher warns once for the ranks,
which load the same configuration again) is logged with `extra=SHOWN`: kept, not printed.

Torch-free: the launcher configures it before torch is imported.
"""

from __future__ import annotations

import logging
import sys

SHOWN = {"shown_elsewhere": True}
KEPT_LOGGERS = ("trainer", "protocol")
KEPT_AT_MOST = 100  # a run that warns at every step keeps the first ones, and says it dropped the rest
LEVEL_WORDS = {logging.DEBUG: "debug", logging.WARNING: "warning", logging.ERROR: "error", logging.CRITICAL: "error"}

_kept: list[str] = []
_dropped = 0
_printed: set[str] = set()  # per process, whatever handler printed them


class MessageFormat(logging.Formatter):
    """`warning: <message>`, `error: <message>`, an info line as it is; with `timestamps`, the
    time first; with `names`, the logger's name before the level word (launcher.log, which also
    holds torch's messages)."""

    def __init__(self, timestamps: bool = False, names: bool = False):
        super().__init__("%(message)s", datefmt="%H:%M:%S")
        self.timestamps, self.names = timestamps, names

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        word = LEVEL_WORDS.get(record.levelno)
        if word:
            text = f"{word}: {text}"
        if self.names:
            text = f"{record.name}: {text}"
        if self.timestamps:
            text = f"{self.formatTime(record, self.datefmt)} {text}"
        return text


class PrintOnce(logging.Filter):
    """Lets through a warning or error only the first time this process logs its text, and never
    one that another process printed (SHOWN)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if getattr(record, "shown_elsewhere", False):
            return False
        text = record.getMessage()
        if text in _printed:
            return False
        _printed.add(text)
        return True


class KeepWarnings(logging.Handler):
    """Keeps the text of each warning and error of the trainer's and the protocol's loggers once."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        global _dropped
        if record.name.split(".", 1)[0] not in KEPT_LOGGERS:
            return
        text = f"{LEVEL_WORDS[record.levelno]}: {record.getMessage()}"
        if text in _kept:
            return
        if len(_kept) < KEPT_AT_MOST:
            _kept.append(text)
        else:
            _dropped += 1


def configure(stream=None, *, timestamps: bool = False, level: int = logging.INFO) -> None:
    """Print this process's messages on `stream` (default stderr) in the one format, and keep its
    warnings. Called again (the trainer does once it trains), it replaces the console and keeps
    what was kept and printed."""
    console = logging.StreamHandler(stream or sys.stderr)
    console.setFormatter(MessageFormat(timestamps))
    console.addFilter(PrintOnce())
    logging.basicConfig(level=level, handlers=[console, KeepWarnings()], force=True)


def kept_warnings() -> list[str]:
    """The warnings and errors kept so far in this process, oldest first, each once."""
    more = [f"warning: {_dropped} more warnings not kept (the first {KEPT_AT_MOST} are)"] if _dropped else []
    return [*_kept, *more]
