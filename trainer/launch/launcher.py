"""The launcher (`python -m trainer.launch`): start the ranks of a run on this machine, report how they ended.

    python -m trainer.launch --nproc N --device cpu|cuda [--log-ranks 0,1] [--max-restarts auto|N]
                               [--nnodes M --rdzv-endpoint HOST:PORT --rdzv-id ID] [--section.key value ...]

torchrun_launch.sh runs it. It checks the configuration first (trainer/preflight/checks.py, in this
process, before torch is imported), then starts `python -m trainer.train` in N processes through
torch's elastic agent, as `torchrun --standalone` does (or joins a c10d rendezvous of M machines
with --nnodes), with the same console: the output of the --log-ranks ranks, each line prefixed
`[rankR]:`. Every rank's stdout and stderr are written to <job.dump_folder>/logs/<time>/rank<R>/,
next to the error report the rank writes (`trainer.launch.process_exit.report_error`). A run that reads
the built-in `python_stdlib` corpus has it prepared here, after the checks, when no earlier run
has (trainer/data/python_corpus.py): the ranks find it in the cache and only read it.

When a rank fails, the launcher prints nothing of torch's own failure report; it prints one block
on stderr and exits:

    error: <the message of the rank that failed first, which may span several lines>
    full logs: <the log folder>

Exit code: 2 when that rank stopped on a user's mistake (it exited 2), 128+N when it was killed by
signal N (the message names the signal and its likely cause), else the rank's exit code.
SIGUSR1 or SIGUSR2 to the launcher is passed on to the ranks (checkpoint.save_on_signal,
trainer/launch/stop_request.py): they save a checkpoint and stop; the launcher prints `stopped: saved a
checkpoint at step N ...` and exits 75, and the same command resumes from that step.
The seed checkpoint (`--checkpoint.create_seed_checkpoint`) runs the same way as one process.

A job's safety:

- The ranks die with the launcher (trainer/launch/launcher_watch.py): torch's agent starts them in
  sessions of their own, out of reach of a signal to the launcher's process group. SIGTERM,
  SIGINT or SIGHUP to the launcher stop them through the agent (exit 128+N).
- One live job per dump folder: the launcher takes <job.dump_folder>/.lock (and the checkpoint
  folder's, when it writes checkpoints) after its checks and before the ranks start, and refuses a
  folder a live job holds (exit 2; trainer/launch/run_lock.py). A job of several machines
  (--nnodes > 1) is locked by its rank 0 instead (see `take_locks`).
- --max-restarts N restarts the ranks after a failure at most N times, each from the newest
  complete checkpoint of the dump folder (the trainer resumes from it by itself), never after a
  user's mistake (exit 2, unless caused by a peer that timed out or vanished). `auto` (the default): 3 when the run saves checkpoints
  (checkpoint.enable without load_only), else 0, since a restart without checkpoints would train
  again from step 0. Each restart is announced on stderr (`rank R died (...); restart K of N from
  the latest checkpoint`) and recorded in run_meta.json (`restart`, `history`); the final report is
  the last attempt's. A rank stopped (SIGSTOP) when a peer fails is killed (trainer/launch/elastic_agent.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse

from trainer.launch import run_lock, stop_request
from trainer.config.job_config import JobConfig
from trainer.config.manager import IGNORED_SHOWN, ConfigError, load_config, with_default_config
from trainer.launch.failure_report import (  # noqa: F401 (the launcher's report, also imported from here)
    Hang,
    RankFailure,
    describe,
    memory_note,
    print_block,
    root_cause,
    short_reason,
)
from trainer.messages import MessageFormat, kept_warnings
from trainer.messages import configure as configure_messages
from trainer.launch.launcher_watch import LAUNCHER_PID_ENV
from trainer.preflight.checks import (RunComplete, check, check_seed, complete_record, describe_run, seed_memory_need,
                               training_memory_need)
from trainer.preflight.data import prepare_builtin_data

logger = logging.getLogger("trainer.launch.launcher")

USAGE = ("usage: python -m trainer.launch --nproc N --device cpu|cuda [--log-ranks R[,R...]] "
         "[--max-restarts auto|N] [--nnodes M --rdzv-endpoint HOST:PORT --rdzv-id ID] [--section.key value ...]")
# --max-restarts auto: this many restarts when the run saves checkpoints, else none.
AUTO_RESTARTS = 3
LOG_STAMP = "%Y%m%d-%H%M%S"


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
    max_restarts: int | None = None  # None: auto (AUTO_RESTARTS with checkpoints, else 0)


def parse_options(argv: list[str]) -> tuple[Options, list[str]]:
    """The launcher's own options, which come first; the rest are the trainer's arguments."""
    opts, i = Options(), 0
    names = {"--nproc": "nproc", "--device": "device", "--log-ranks": "log_ranks", "--nnodes": "nnodes",
             "--rdzv-endpoint": "rdzv_endpoint", "--rdzv-id": "rdzv_id", "--max-restarts": "max_restarts"}
    while i < len(argv) and argv[i] in names:
        if i + 1 >= len(argv):
            raise UsageError(f"{argv[i]} needs a value")
        name, value = names[argv[i]], argv[i + 1]
        try:
            if name in ("nproc", "nnodes"):
                setattr(opts, name, int(value))
                if getattr(opts, name) < 1:
                    raise ValueError
            elif name == "max_restarts":
                opts.max_restarts = None if value == "auto" else int(value)
                if value != "auto" and opts.max_restarts < 0:
                    raise ValueError
            elif name == "log_ranks":
                opts.log_ranks = {int(r) for r in value.split(",") if r.strip()}
            else:
                setattr(opts, name, value)
        except ValueError:
            valid = "'auto' or a number >= 0 (MAX_RESTARTS)" if name == "max_restarts" else "valid"
            raise UsageError(f"{argv[i]}: {value!r} is not {valid}") from None
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
# Hugging Face datasets without a network


def hub_datasets(config: JobConfig) -> list[str]:
    """Datasets the ranks will stream from the Hugging Face hub (not a local copy)."""
    from trainer.data.build import BUILT_IN

    names = []
    for section in (config.training, config.validation):
        if section is config.validation and not config.validation.enable:
            continue
        if section.dataset not in ("", *BUILT_IN, "files") and not section.dataset_path:
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
    # launcher.log is a second copy of what matters: on a full disk its writes fail, and the
    # console must show the run's one error block, not a "--- Logging error ---" per line.
    logging.raiseExceptions = False
    handler = logging.FileHandler(folder / "launcher.log")
    handler.setFormatter(MessageFormat(timestamps=True, names=True))
    for name in ("py.warnings", "trainer.launch.launcher"):
        logging.getLogger(name).handlers = [handler]
        logging.getLogger(name).propagate = False
    for name in ["torch", *(n for n in logging.Logger.manager.loggerDict if n.startswith("torch."))]:
        log = logging.getLogger(name)
        if any(type(h) is logging.StreamHandler for h in log.handlers):
            log.handlers = [h for h in log.handlers if type(h) is not logging.StreamHandler] + [handler]
    logging.getLogger("trainer.launch.launcher").setLevel(logging.INFO)
    logging.captureWarnings(True)
    for warning in kept_warnings():  # what the checks printed before this log existed
        logger.info("%s", warning)


def rank_logs(opts: Options, folder: Path):
    """torch's LogsSpecs for <folder>/rank<R>/{stdout.log, stderr.log, error.json} (restart K:
    <folder>/restart<K>/rank<R>/); the shown local ranks are also tailed to the console with a
    `[rankR]:` prefix (torchrun's --tee 3 --local-ranks-filter)."""
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.api import LogsDest

    from trainer.launch.elastic_agent import attempt_folder

    class RankLogs(LogsSpecs):
        def __init__(self):
            super().__init__(log_dir=str(folder), local_ranks_filter=opts.log_ranks)

        @property
        def root_log_dir(self) -> str:
            return str(folder)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest()
            for local_rank, env in envs.items():
                attempt = attempt_folder(folder, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
                rank_dir = attempt / f"rank{env.get('RANK', local_rank)}"
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

    return RankLogs()


def restart_notice(resume_note: str, hang: Hang):
    """What the agent calls before an automatic restart: one line on the console (stderr, as the
    failure report) and in launcher.log, plus what is known of a hang."""

    def notice(cause: RankFailure, restart: int, max_restarts: int, stopped: list[int]) -> None:
        line = f"rank {cause.rank} died ({short_reason(cause)}); restart {restart} of {max_restarts} {resume_note}"
        if cause.timed_out:
            line += "\n" + replace(hang, stopped=stopped).explain()
        logger.info("%s", line)
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)

    return notice


@dataclass
class Outcome:
    """How the ranks ended: failures None when they succeeded."""

    failures: list[RankFailure] | None
    restarts: int = 0  # automatic restarts done
    stopped: list[int] = field(default_factory=list)  # ranks found stopped (SIGSTOP) at the last failure


def run_ranks(opts: Options, args: list[str], folder: Path, max_restarts: int = 0,
              on_restart=None) -> Outcome:
    """Start `python -u -m trainer.train ARGS` in opts.nproc processes; restart them after a
    failure at most `max_restarts` times (trainer/launch/elastic_agent.py)."""
    from trainer.launch.elastic_agent import launch

    route_torch_logs(folder)
    if opts.nnodes > 1:
        endpoint, run_id = opts.rdzv_endpoint, opts.rdzv_id
    else:  # torchrun --standalone: a c10d store of this launcher on a free port
        endpoint, run_id = "localhost:0", str(uuid.uuid4())
    # Every rank dies with this process, however it dies (trainer/launch/launcher_watch.py).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    # A fresh c10d store for each attempt. The agent's shared store (torch's default) keeps the
    # keys of the attempt before a restart, where gloo finds the dead ranks' addresses: the
    # restarted ranks then fail with "connectFullMesh failed ... Connection refused".
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agent, failures = launch(nnodes=opts.nnodes, nproc=opts.nproc, endpoint=endpoint, run_id=run_id,
                             max_restarts=max_restarts, logs_specs=rank_logs(opts, folder), log_folder=folder,
                             on_restart=on_restart, args=args)
    return Outcome(failures, agent.restarts_done, agent.stopped_ranks)


def restarts_for(opts: Options, config: JobConfig) -> tuple[int, str]:
    """(how many automatic restarts, what a restart starts from, for the console)."""
    saves = config.checkpoint.enable and not config.checkpoint.load_only
    if config.checkpoint.create_seed_checkpoint:
        return 0, ""
    count = opts.max_restarts if opts.max_restarts is not None else (AUTO_RESTARTS if saves else 0)
    note = ("from the latest checkpoint" if saves else
            "from the start (checkpoint.enable is off or load_only: nothing trained is kept)")
    return count, note


def prepare(opts: Options, config: JobConfig):
    """The launcher's checks of the configuration before anything starts, then the built-in
    corpus prepared when the run reads it and no earlier run has (the ranks only read it): what
    the run needs of host memory, or ConfigError."""
    world = opts.nproc * opts.nnodes
    if config.checkpoint.create_seed_checkpoint:
        if opts.nnodes > 1:
            raise ConfigError("checkpoint.create_seed_checkpoint: runs as ONE process on one machine; "
                              "leave out --nnodes")
        opts.nproc, opts.log_ranks = 1, {0}  # one process, whatever NGPU and the degrees say
        check_seed(config)
        print(f"config: {config.job.config_file or '(defaults)'}; model {config.model.flavor}; seed checkpoint "
              "in one process")
        return seed_memory_need(config)
    plan = check(config, world, opts.device, local_procs=opts.nproc)
    print(describe_run(config, plan, world, opts.device))
    prepare_builtin_data(config, say=lambda line: print(line, flush=True))
    return training_memory_need(config, plan.dims, opts.device, opts.nproc)


def estimate_memory(args: list[str], world: int) -> None:
    """memory_estimation.enable: the estimator's report of the job at this world size, printed
    before the ranks start (training starts whatever it says)."""
    print(f"memory_estimation.enable: estimating every rank's memory at {world} ranks (python -m trainer.estimate)",
          flush=True)
    done = subprocess.run([sys.executable, "-m", "trainer.estimate", "--nproc", str(world), *args])
    if done.returncode:
        print(f"warning: the memory estimate failed (exit {done.returncode}); training anyway", flush=True)


def take_locks(opts: Options, config: JobConfig) -> list[run_lock.RunLock]:
    """The locks of the folders the run writes (trainer/launch/run_lock.py), for a run of one machine. A
    run of several machines is locked by its rank 0 once the rendezvous has decided which
    machine that is (trainer.train.hold_run_locks): a refusal here, on one machine, would leave
    the others waiting for the rendezvous until it times out."""
    if opts.nnodes > 1:
        return []
    locks = run_lock.take_all(run_lock.folders_of(config))
    for lock in locks:
        if lock.note:
            print(f"note: {lock.note}", flush=True)
    return locks


def end_complete_run(opts: Options, config: JobConfig, done: RunComplete) -> int:
    """The run is finished already (its final checkpoint is there): say so, and complete its
    record if it stopped before writing its end, holding the run's locks while writing it (a live
    job in the folder is refused, as for a run that trains)."""
    locks = take_locks(opts, config)
    try:
        print(done.message + complete_record(config), flush=True)
    finally:
        run_lock.release_all(locks)
    return 0


def main(argv: list[str]) -> int:
    configure_messages(level=logging.WARNING)  # the launcher's own lines are printed; its modules' info is not
    try:
        opts, args = parse_options(argv)
    except UsageError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return 2
    args = with_default_config(args)  # the ranks get the same explicit config file
    if "-h" in args or "--help" in args:  # one process answers, without a log folder
        print(f"{USAGE}\n(the launcher's own options, which torchrun_launch.sh sets from NGPU, LOG_RANK and MAX_RESTARTS; "
              "several machines: docs/training.md)\n", flush=True)
        os.execv(sys.executable, [sys.executable, "-m", "trainer.train", *args])
    try:
        config = load_config(args)
        if config.job.print_config:
            os.execv(sys.executable, [sys.executable, "-m", "trainer.train", *args])
        try:
            need = prepare(opts, config)
        except RunComplete as done:
            return end_complete_run(opts, config, done)
        estimation = config.memory_estimation
        if estimation.enable and not estimation.disable_fake_mode and not config.checkpoint.create_seed_checkpoint:
            estimate_memory(args, opts.nproc * opts.nnodes)
        locks = take_locks(opts, config)
    except (ConfigError, run_lock.LockRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run_job(opts, args, config, need)
    finally:
        run_lock.release_all(locks)


def run_job(opts: Options, args: list[str], config: JobConfig, need) -> int:
    """Start the ranks (the dump folder is this job's now) and report how they ended."""
    try:
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
    max_restarts, resume_note = restarts_for(opts, config)
    hang = Hang(config.comm.train_timeout_seconds, config.comm.init_timeout_seconds)
    try:
        outcome = run_ranks(opts, args, folder, max_restarts, restart_notice(resume_note, hang))
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
    if outcome.failures is None:
        logger.info("all ranks succeeded in %.1f s after %d restarts", time.time() - started, outcome.restarts)
        return 0
    return report(outcome, config, need, folder, offline_host)


def report(outcome: Outcome, config: JobConfig, need, folder: Path, offline_host: str | None) -> int:
    """The one failure block of the last attempt; the launcher's exit code."""
    failures = outcome.failures
    cause = root_cause(failures)
    if all(failure.saved_and_stopped for failure in failures):
        print(f"stopped: {cause.message or 'the ranks saved a checkpoint and stopped on request'}", file=sys.stderr,
              flush=True)
        return stop_request.SAVED_AND_STOPPED
    for failure in sorted(failures, key=lambda f: f.rank):
        logger.info("rank %d: exit %d at %.3f: %s", failure.rank, failure.exitcode, failure.time, failure.message)
    hang = Hang(config.comm.train_timeout_seconds, config.comm.init_timeout_seconds, outcome.stopped)
    message, code = describe(cause, memory_note(need), hang)
    if offline_host and cause.message and ("OfflineModeIsEnabled" in cause.message or "offline" in cause.message):
        message += (f"\n({offline_host} could not be resolved when the run started, so the ranks ran with "
                    "HF_HUB_OFFLINE=1: download the dataset where there is a network, or set training.dataset_path "
                    "to a local copy)")
    if outcome.restarts:
        message += f"\n(the last of {outcome.restarts + 1} attempts: the job was restarted {outcome.restarts} times)"
    print_block(message, folder)
    return code
