"""`python -m trainer.launcher`: start the ranks of a run on this machine, report how they ended.

    python -m trainer.launcher --nproc N --device cpu|cuda [--log-ranks 0,1]
                               [--nnodes M --rdzv-endpoint HOST:PORT --rdzv-id ID] [--section.key value ...]

torchrun_launch.sh runs it. It checks the configuration first (trainer/preflight.py, in this
process, before torch is imported), then starts `python -m trainer.train` in N processes through
torch's elastic agent, as `torchrun --standalone` does (or joins a c10d rendezvous of M machines
with --nnodes), with the same console: the output of the --log-ranks ranks, each line prefixed
`[rankR]:`. Every rank's stdout and stderr are written to <job.dump_folder>/logs/<time>/rank<R>/,
next to the error report the rank writes (`trainer.process_exit.report_error`).

When a rank fails, the launcher prints nothing of torch's own failure report; it prints one block
on stderr and exits:

    error: <the message of the rank that failed first, which may span several lines>
    full logs: <the log folder>

Exit code: 2 when that rank stopped on a user's mistake (it exited 2), 128+N when it was killed by
signal N (the message names the signal and its likely cause), else the rank's exit code.
The seed checkpoint (`--checkpoint.create_seed_checkpoint`) runs the same way as one process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse

from trainer.config.job_config import JobConfig
from trainer.config.manager import IGNORED_SHOWN, ConfigError, load_config, with_default_config
from trainer.preflight import (
    MemoryNeed,
    available_memory,
    check,
    check_seed,
    describe_run,
    gb,
    seed_memory_need,
    training_memory_need,
)

logger = logging.getLogger("trainer.launcher")

USAGE = ("usage: python -m trainer.launcher --nproc N --device cpu|cuda [--log-ranks R[,R...]] "
         "[--nnodes M --rdzv-endpoint HOST:PORT --rdzv-id ID] [--section.key value ...]")
LOG_STAMP = "%Y%m%d-%H%M%S"

# How the agent stops the other ranks once one has failed (and how a scheduler or a user stops a
# run): a rank ended by one of these did not cause the failure.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
# What a rank sees when a peer died under it: a consequence, not the cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "ncclRemoteError", "remote process exited or there was a network error")
# A rank killed by a signal is noticed only at the agent's next poll, and the agent's time for it
# is in whole seconds; a signal death up to this long after the first reported error is taken as
# the cause (a rank rarely dies of a signal because a peer failed; the reverse is the rule).
SIGNAL_GRACE_S = 5.0


class UsageError(ValueError):
    pass


@dataclass
class Options:
    nproc: int = 1  # processes on this machine
    device: str = "cpu"
    log_ranks: set[int] = field(default_factory=lambda: {0})
    nnodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = ""


def parse_options(argv: list[str]) -> tuple[Options, list[str]]:
    """The launcher's own options, which come first; the rest are the trainer's arguments."""
    opts, i = Options(), 0
    names = {"--nproc": "nproc", "--device": "device", "--log-ranks": "log_ranks", "--nnodes": "nnodes",
             "--rdzv-endpoint": "rdzv_endpoint", "--rdzv-id": "rdzv_id"}
    while i < len(argv) and argv[i] in names:
        if i + 1 >= len(argv):
            raise UsageError(f"{argv[i]} needs a value")
        name, value = names[argv[i]], argv[i + 1]
        try:
            if name in ("nproc", "nnodes"):
                setattr(opts, name, int(value))
                if getattr(opts, name) < 1:
                    raise ValueError
            elif name == "log_ranks":
                opts.log_ranks = {int(r) for r in value.split(",") if r.strip()}
            else:
                setattr(opts, name, value)
        except ValueError:
            raise UsageError(f"{argv[i]}: {value!r} is not valid") from None
        i += 2
    if opts.device not in ("cpu", "cuda"):
        raise UsageError(f"--device: {opts.device!r} is not cpu or cuda")
    outside = sorted(rank for rank in opts.log_ranks if rank >= opts.nproc)
    if outside:
        raise UsageError(f"--log-ranks (LOG_RANK): rank {outside[0]} is not one of this machine's {opts.nproc} "
                         f"processes (0-{opts.nproc - 1}); nothing of it would be shown")
    if opts.nnodes > 1 and not (opts.rdzv_endpoint and opts.rdzv_id):
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint and --rdzv-id (the same on every machine)")
    return opts, argv[i:]


# ---------------------------------------------------------------------------------------------
# Failures: which rank failed first, and what to tell the user


@dataclass
class RankFailure:
    """How one rank ended, from torch's ProcessFailure and the rank's own report."""

    rank: int
    exitcode: int  # negative: killed by signal -exitcode
    time: float  # when it failed: the report's precise time, else when the agent noticed (whole seconds)
    message: str | None = None  # the rank's report
    log_dir: Path | None = None

    @property
    def signal(self) -> signal.Signals | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode)
        except ValueError:
            return None

    @property
    def peer_lost(self) -> bool:
        return bool(self.message) and any(text in self.message for text in PEER_LOST)

    @classmethod
    def from_torch(cls, rank: int, failure, folder: Path | None) -> RankFailure:
        """From a torch.distributed.elastic ProcessFailure."""
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        ours = data.get("trainer")
        message, when = None, float(failure.timestamp)
        if isinstance(ours, dict) and isinstance(ours.get("message"), str):
            message, when = ours["message"], float(ours.get("time", when))
        elif isinstance(failure.message, dict):  # written by torch's @record / ErrorHandler
            message = str(failure.message.get("message", "")) or None
        elif data.get("message") not in (None, "<NONE>"):  # an error file with a plain message
            message = str(failure.message) or None
        log_dir = folder / f"rank{rank}" if folder is not None else None
        return cls(rank=rank, exitcode=failure.exitcode, time=when, message=message, log_dir=log_dir)


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The rank that failed first, not one that failed because of it: a rank stopped by the
    agent's SIGTERM or one that lost its connection to a dead peer is a consequence. Among the
    others, a rank killed by a signal (noticed late, see SIGNAL_GRACE_S) comes first, then the
    earliest report."""
    earliest = min(f.time for f in failures)

    def rank_of(f: RankFailure) -> tuple:
        if f.signal in STOP_SIGNALS:
            tier = 3
        elif f.peer_lost:
            tier = 2
        elif f.signal is not None and f.time <= earliest + SIGNAL_GRACE_S:
            tier = 0
        else:
            tier = 1
        return tier, f.time, f.rank

    return min(failures, key=rank_of)


SIGNAL_CAUSES = {
    signal.SIGKILL: "most likely the kernel's out-of-memory killer (`dmesg | grep -i -e oom -e killed` or "
                    "`journalctl -k` says so); else a `kill -9` from a user or a scheduler",
    signal.SIGSEGV: "a crash in native code (torch, a communication library, a driver)",
    signal.SIGBUS: "a crash in native code (often a full /dev/shm or a truncated memory-mapped file)",
    signal.SIGABRT: "an abort in native code (a failed check in torch, a communication library or a driver)",
    signal.SIGILL: "a crash in native code (an instruction this CPU does not have)",
    signal.SIGFPE: "a crash in native code (an arithmetic fault)",
}
NATIVE_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


def describe(failure: RankFailure, memory: str | None = None) -> tuple[str, int]:
    """(the message, the launcher's exit code) for the rank that failed first. `memory` says
    what the run needs of host memory, for a kill by the out-of-memory killer."""
    who = f"rank {failure.rank}"
    sig = failure.signal
    if sig is not None:
        cause = SIGNAL_CAUSES.get(sig, "sent from outside the run (kill, a scheduler's time limit, a shutdown)")
        text = f"{who} was killed by {sig.name} (signal {sig.value}): {cause}"
        if sig == signal.SIGKILL and memory:
            text += f"; {memory}"
        if sig in NATIVE_CRASHES and failure.log_dir is not None:
            text += f"; the Python stack of every thread at the crash is at the end of {failure.log_dir / 'stderr.log'}"
            stack = crash_stack(failure.log_dir / "stderr.log")
            if stack:
                text += "\nwhere it crashed (most recent call first):\n" + "\n".join(stack)
        return text, 128 + sig.value
    if failure.exitcode < 0:  # a signal number this platform does not name
        return f"{who} was killed by signal {-failure.exitcode}", 128 - failure.exitcode
    code = failure.exitcode
    if failure.message:
        text = f"{who} (exit {code}): {failure.message}"
        if failure.peer_lost:
            text += ("\n(this rank lost its connection to another one, which failed first without a report: see the "
                     "logs of the other ranks, and of the other machines in a multi-machine run)")
        return text, 2 if code == 2 else code
    last = last_line(failure.log_dir / "stderr.log") if failure.log_dir is not None else None
    text = f"{who} exited with code {code} without reporting an error"
    if last:
        text += f"; the last line of its stderr: {last}"
    return text, code


def tail_lines(path: Path, size: int = 8192) -> list[str] | None:
    """The lines of the last `size` bytes of a file, stripped, or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return [line.strip() for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None


def last_line(path: Path) -> str | None:
    lines = [line for line in tail_lines(path) or [] if line]
    return lines[-1] if lines else None


def crash_stack(path: Path, frames: int = 8) -> list[str]:
    """The innermost frames of the crashing thread in the stack dump Python's faulthandler wrote
    at the end of a rank's stderr (its 'Current thread ...' block), so that the report of a
    native crash says where it happened even where only the console is kept (CI, a scheduler)."""
    lines = tail_lines(path, 65536) or []
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if not starts:
        return []
    block = []
    for line in lines[starts[-1] + 1:]:
        if not line.startswith("File "):
            break
        block.append(f"  {line}")
    return block[:frames]


def print_block(message: str, folder: Path | None) -> None:
    """The one failure report: `error: ...` (maybe several lines), then `full logs: <folder>`."""
    sys.stdout.flush()
    block = f"error: {message}\n"
    if folder is not None:
        block += f"full logs: {folder}\n"
    sys.stderr.write(block)
    sys.stderr.flush()


def memory_note(need: MemoryNeed | None, meminfo: str | None = None) -> str | None:
    """What the run needs of host memory at least, for a rank killed by the out-of-memory killer."""
    if need is None:
        return None
    available = available_memory(meminfo)
    note = f"this run needs at least {gb(need.bytes)} of host memory"
    if available is not None:
        note += f" ({gb(available)} were available when it started)"
    return f"{note}: {need.what}"


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets without a network


def hub_datasets(config: JobConfig) -> list[str]:
    """Datasets the ranks will stream from the Hugging Face hub (not a local copy)."""
    names = []
    for section in (config.training, config.validation):
        if section is config.validation and not config.validation.enable:
            continue
        if section.dataset not in ("", "synthetic", "files") and not section.dataset_path:
            names.append(section.dataset)
    return names


def hub_unreachable(resolve=socket.getaddrinfo, timeout_s: float = 5.0) -> str | None:
    """The hub's host when its name does not resolve (no network, no DNS), else None.

    Without a network, `datasets` retries for about 25 s before it gives up. Only a definite
    answer counts: a lookup still pending after `timeout_s` or any other error says nothing.
    Not asked when the hub is reached through a proxy, or offline mode is set already.
    """
    if any(os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy",
                                       "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    outcome: list[BaseException | None] = []

    def lookup():
        try:
            resolve(host, 443)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            outcome.append(e)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return host if outcome and isinstance(outcome[0], socket.gaierror) else None


# ---------------------------------------------------------------------------------------------
# Starting the ranks


def new_log_folder(dump_folder: str, suffix: str = "") -> Path:
    root = Path(dump_folder).resolve() / "logs"
    stamp = datetime.now().strftime(LOG_STAMP) + suffix
    for n in range(1000):
        folder = root / (stamp if n == 0 else f"{stamp}.{n}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise ConfigError(f"job.dump_folder: cannot create a new log folder under {root}")


def route_torch_logs(folder: Path) -> None:
    """torch.distributed.elastic's own messages (its settings, 'Sending process ... closing signal
    SIGTERM', its failure report) and Python warnings go to <logs>/launcher.log, not to the
    console. Called once torch is imported: torch._logging gives many `torch.*` loggers their own
    console handler then."""
    handler = logging.FileHandler(folder / "launcher.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("py.warnings", "trainer.launcher"):
        logging.getLogger(name).handlers = [handler]
        logging.getLogger(name).propagate = False
    for name in ["torch", *(n for n in logging.Logger.manager.loggerDict if n.startswith("torch."))]:
        log = logging.getLogger(name)
        if any(type(h) is logging.StreamHandler for h in log.handlers):
            log.handlers = [h for h in log.handlers if type(h) is not logging.StreamHandler] + [handler]
    logging.getLogger("trainer.launcher").setLevel(logging.INFO)
    logging.captureWarnings(True)


def run_ranks(opts: Options, args: list[str], folder: Path) -> list[RankFailure] | None:
    """Start `python -u -m trainer.train ARGS` in opts.nproc processes; None when all succeed,
    else every failed rank."""
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.api import LogsDest
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    route_torch_logs(folder)

    class RankLogs(LogsSpecs):
        """<folder>/rank<R>/{stdout.log, stderr.log, error.json}; the shown local ranks are also
        tailed to the console with a `[rankR]:` prefix (torchrun's --tee 3 --local-ranks-filter)."""

        def __init__(self):
            super().__init__(log_dir=str(folder), local_ranks_filter=opts.log_ranks)

        @property
        def root_log_dir(self) -> str:
            return str(folder)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank_dir = folder / f"rank{env.get('RANK', local_rank)}"
                rank_dir.mkdir(parents=True, exist_ok=True)
                error_file = rank_dir / "error.json"
                error_file.unlink(missing_ok=True)
                env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
                dest.error_files[local_rank] = str(error_file)
                dest.stdouts[local_rank] = str(rank_dir / "stdout.log")
                dest.stderrs[local_rank] = str(rank_dir / "stderr.log")
                if local_rank in opts.log_ranks:
                    dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
                    dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
            return dest

    if opts.nnodes > 1:
        endpoint, run_id = opts.rdzv_endpoint, opts.rdzv_id
    else:  # torchrun --standalone: a c10d store of this launcher on a free port
        endpoint, run_id = "localhost:0", str(uuid.uuid4())
    config = LaunchConfig(
        min_nodes=opts.nnodes, max_nodes=opts.nnodes, nproc_per_node=opts.nproc, run_id=run_id, role="rank",
        rdzv_endpoint=endpoint, rdzv_backend="c10d", max_restarts=0, monitor_interval=0.1, logs_specs=RankLogs(),
        log_line_prefix_template="[rank${rank}]:",  # the global rank (torchrun's default is the local one)
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "trainer.train", *args)
    except ChildFailedError as e:
        return [RankFailure.from_torch(rank, failure, folder) for rank, failure in e.failures.items()]
    return None


def main(argv: list[str]) -> int:
    try:
        opts, args = parse_options(argv)
    except UsageError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return 2
    args = with_default_config(args)  # the ranks get the same explicit config file
    if "-h" in args or "--help" in args:  # one process answers, without a log folder
        os.execv(sys.executable, [sys.executable, "-m", "trainer.train", *args])
    try:
        config = load_config(args)
        if config.job.print_config:
            os.execv(sys.executable, [sys.executable, "-m", "trainer.train", *args])
        world = opts.nproc * opts.nnodes
        if config.checkpoint.create_seed_checkpoint:
            if opts.nnodes > 1:
                raise ConfigError("checkpoint.create_seed_checkpoint: runs as ONE process on one machine; "
                                  "leave out --nnodes")
            opts.nproc, opts.log_ranks = 1, {0}  # one process, whatever NGPU and the degrees say
            check_seed(config)
            need = seed_memory_need(config)
            print(f"config: {config.job.config_file or '(defaults)'}; model {config.model.flavor}; seed checkpoint "
                  "in one process")
        else:
            plan = check(config, world, opts.device, local_procs=opts.nproc)
            need = training_memory_need(config, plan.dims, opts.device, opts.nproc)
            print(describe_run(config, plan, world, opts.device))
        folder = new_log_folder(config.job.dump_folder, f"-{socket.gethostname()}" if opts.nnodes > 1 else "")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"outputs: {Path(config.job.dump_folder).resolve()}")
    print(f"logs: {folder}", flush=True)

    datasets = hub_datasets(config)
    offline_host = hub_unreachable() if datasets else None
    if offline_host:
        os.environ["HF_HUB_OFFLINE"] = "1"
        print(f"note: {offline_host} cannot be resolved (no network?): the ranks look for {', '.join(datasets)} in "
              "the local Hugging Face cache only (HF_HUB_OFFLINE=1)", flush=True)
    if opts.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes must not each take every core
    os.environ[IGNORED_SHOWN] = "1"  # the ranks load the config again: one warning is enough

    started = time.time()
    try:
        failures = run_ranks(opts, args, folder)
    except KeyboardInterrupt:  # Ctrl-C before the agent's own signal handling is in place
        print_block("interrupted (SIGINT) while starting the ranks", folder)
        return 130
    except Exception as e:  # noqa: BLE001 (the agent's own failure: rendezvous, a signal to this process)
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(e, SignalException):
            sig = signal.Signals(e.sigval)
            print_block(f"the launcher received {sig.name}; the ranks were stopped", folder)
            return 128 + sig.value
        logger.exception("the launcher failed")
        print_block(f"the launcher failed: {type(e).__name__}: {e} (traceback in {folder / 'launcher.log'})", folder)
        return 1
    if failures is None:
        logger.info("all ranks succeeded in %.1f s", time.time() - started)
        return 0
    cause = root_cause(failures)
    for failure in sorted(failures, key=lambda f: f.rank):
        logger.info("rank %d: exit %d at %.3f: %s", failure.rank, failure.exitcode, failure.time, failure.message)
    message, code = describe(cause, memory_note(need))
    if offline_host and cause.message and ("OfflineModeIsEnabled" in cause.message or "offline" in cause.message):
        message += (f"\n({offline_host} could not be resolved when the run started, so the ranks ran with "
                    "HF_HUB_OFFLINE=1: download the dataset where there is a network, or set training.dataset_path "
                    "to a local copy)")
    print_block(message, folder)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
