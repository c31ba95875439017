"""What a failed run's summary says: why it ended, and the part of its log that shows the error.

The launcher ends a failed run's output with one message block: a line starting `error: ` (the
failing rank's own message, possibly several lines) and a line starting `full logs: `. That
block is the summary; torchrun's own report above it (`error_file: <N/A>`, `traceback : To
enable traceback ...`) says nothing about the cause. Without such a line the summary is the last
lines of the log.

A run killed by a signal (Popen's negative return code, or 128 + N from the launcher) is named
by its signal with the usual cause; SIGKILL is mostly the kernel's out-of-memory killer, and
for the seed run the message says how much host memory it needs.
"""

from __future__ import annotations

import signal
from pathlib import Path

from protocol.plan.model import Launch

TAIL_LINES = 15
MAX_BLOCK_LINES = 40
ERROR_PREFIX = "error: "
BYTES_PER_PARAMETER = 4  # the seed initializes and saves the model in fp32
CAUSES = {
    "SIGKILL": "usually the kernel's out-of-memory killer (see dmesg or the node's kernel log)",
    "SIGTERM": "ended from outside: a scheduler's time limit, or someone stopped it",
    "SIGINT": "interrupted",
    "SIGSEGV": "a crash in native code (the log shows the Python stacks of that moment)",
    "SIGABRT": "aborted by a failed check in native code",
    "SIGBUS": "often shared memory (/dev/shm) running out",
}


def exit_problem(returncode: int, launch: Launch) -> str:
    """'exit 3', or 'killed by SIGKILL (exit -9): usually the kernel's out-of-memory killer ...'."""
    name = signal_name(returncode)
    if name is None:
        return f"exit {returncode}"
    text = f"killed by {name} (exit {returncode})"
    cause = CAUSES.get(name)
    if cause:
        text += f": {cause}"
    if name == "SIGKILL" and launch.role == "seed":
        text += f"; {seed_memory(launch)}"
    return text


def signal_name(returncode: int) -> str | None:
    """The signal behind a return code: -N from Popen, 128 + N from a shell or the launcher."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def seed_memory(launch: Launch) -> str:
    """How much host memory the seed run needs: the whole model, in fp32, in one process."""
    from trainer.config.manager import ConfigError, load_config
    from trainer.models.llama3.args import num_params
    from trainer.models.llama3.hf_config import configured_model_args

    try:
        model = load_config(list(launch.args)).model
        flavor, count = model.flavor, num_params(configured_model_args(model))
    except (ConfigError, ValueError):
        return "the seed run holds the whole model in fp32 (4 bytes per parameter) in one process"
    need = count * BYTES_PER_PARAMETER
    size = f"{need / 1e9:.1f} GB" if need >= 1e9 else f"{need / 1e6:.1f} MB"
    return (f"the seed run holds the whole {flavor} model in fp32 in one process: {count:,} parameters x "
            f"{BYTES_PER_PARAMETER} bytes = {size} of host memory, plus what Python and torch take")


def summary(log: Path, start: int = 0) -> tuple[str, str]:
    """(title, text) of the log written since byte offset `start`: ("error", the launcher's error
    block) when there is one, else ("last lines", the last TAIL_LINES lines)."""
    lines = read_lines(log, start)
    block = error_block(lines)
    if block is not None:
        return "error", "\n".join(block)
    if not lines:
        return "last lines", "(the log has no output)"
    return "last lines", "\n".join(lines[-TAIL_LINES:])


def error_block(lines: list[str]) -> list[str] | None:
    """From the last line starting with 'error: ' to the end (blank lines at the end dropped),
    at most MAX_BLOCK_LINES of it; None when no line starts so."""
    starts = [i for i, line in enumerate(lines) if line.startswith(ERROR_PREFIX)]
    if not starts:
        return None
    block = lines[starts[-1]:]
    while block and not block[-1].strip():
        block.pop()
    if len(block) > MAX_BLOCK_LINES:
        block = block[:MAX_BLOCK_LINES] + [f"... ({len(block) - MAX_BLOCK_LINES} more lines in the log)"]
    return block


def read_lines(path: Path, start: int = 0) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())
