"""The launcher's elastic agent: torch's LocalElasticAgent, with this trainer's restart policy.

`launch()` does what torch's `elastic_launch` does (a c10d rendezvous, one agent that starts
and watches this machine's ranks), with an agent that

- restarts the ranks after a failure at most `max_restarts` times, but never after a user's
  mistake (the rank that failed first exited 2: the same mistake would stop every attempt);
- says why before each restart (the launcher prints `rank R died (...); restart 1 of N ...`); the
  ranks resume from the newest complete checkpoint of the dump folder by themselves;
- kills a stopped rank (SIGSTOP, a debugger) with SIGKILL when it stops the ranks: a stopped
  process does not act on the SIGTERM the agent sends, which would leave the agent waiting
  its shutdown timeout (30 s) and then leave nothing for a restart to run on;
- keeps, for the final report, which ranks it found stopped when a rank failed.

Each attempt's logs go to <logs>/rank<R>/ (the first) and <logs>/restart<K>/rank<R>/ (restart K):
torch opens them for writing, so one folder per attempt keeps every attempt's output.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry

from trainer.launch import rank_store
from trainer.launch.failure_report import RankFailure, root_cause
from trainer.launch.process_exit import DIVERGED
from trainer.launch.stop_request import SAVED_AND_STOPPED, catches, received

USER_MISTAKE = 2  # a rank's exit code for a mistake in the config, the data or a checkpoint
# Told before each restart: (the rank that failed first, this restart's number, the most
# restarts, the ranks found stopped).
OnRestart = Callable[[RankFailure, int, int, list[int]], None]


def attempt_folder(folder: Path, restart: int) -> Path:
    """Where the logs of attempt `restart` (0: the first start) go."""
    return folder if restart == 0 else folder / f"restart{restart}"


def retryable(cause: RankFailure) -> bool:
    """Whether a restart can help: not after a user's mistake (exit 2), unless that error came
    from a peer that stopped answering or vanished (a checkpoint that could not be written because
    a collective timed out is reported with exit 2, but the next attempt can write it); not after
    a stop on request, nor after training diverged (exit 3: it would again, from the same
    checkpoint)."""
    if cause.exitcode in (SAVED_AND_STOPPED, DIVERGED):  # it saved and is done; it would diverge again
        return False
    return cause.exitcode != USER_MISTAKE or cause.timed_out or cause.peer_lost


STOPPED = ("T", "t")  # /proc states: stopped by a signal, stopped by a debugger


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, D, T stopped, t traced, Z), None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class RankAgent(LocalElasticAgent):
    def __init__(self, *args, log_folder: Path, on_restart: OnRestart, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_folder, self.on_restart = log_folder, on_restart
        self.restarts_done = 0
        self.stopped_ranks: list[int] = []  # stopped when the last failure was seen
        self.passed_on: set[tuple[int, signal.Signals]] = set()  # (rank pid, stop signal) sent
        self.rank_store = None  # the store this attempt's ranks meet at, on node 0 (trainer/launch/rank_store.py)

    def _rendezvous(self, worker_group) -> None:
        """torch's rendezvous of the nodes, then a fresh store for this attempt's ranks in place of
        the port torch found free, which another process can take before rank 0 listens on it."""
        super()._rendezvous(worker_group)
        self.rank_store = None  # the last attempt's store closes before the next opens
        self.rank_store, worker_group.master_port = rank_store.host(worker_group.store, worker_group.group_rank,
                                                                    worker_group.master_addr)

    def failures_of(self, result: RunResult) -> list[RankFailure]:
        """The failed ranks of the current attempt; those this agent killed because they were
        stopped are marked, they are not the cause of a report."""
        folder = attempt_folder(self.log_folder, self.restarts_done)
        failures = [RankFailure.from_torch(rank, failure, folder) for rank, failure in result.failures.items()]
        for failure in failures:
            failure.killed_stopped = failure.rank in self.stopped_ranks
        return failures

    def _monitor_workers(self, worker_group):
        self.pass_on_stop_signals()
        stopped = self.kill_stopped_after_failure(worker_group)
        if stopped:
            self.stopped_ranks = stopped
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            if not retryable(root_cause(self.failures_of(result))):
                self._remaining_restarts = 0  # the same mistake would end every attempt
            self.last_failure = result
        return result

    def pass_on_stop_signals(self) -> None:
        """Send each stop signal the launcher got (trainer/launch/stop_request.py) to every rank once,
        as soon as the rank handles it (a rank still importing would die of it)."""
        signals = received()
        if not signals or not self._pcontext:
            return
        for pid in self._pcontext.pids().values():
            for sig in signals:
                if (pid, sig) not in self.passed_on and catches(pid, sig):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                    self.passed_on.add((pid, sig))

    def kill_stopped_after_failure(self, worker_group) -> list[int]:
        """Once a rank has failed, SIGKILL the ranks whose process is stopped (SIGSTOP, a
        debugger), before torch's poll stops the others with SIGTERM, which a stopped process
        would act on only when continued (torch waits 30 s, then kills). Returns their global
        ranks. (Popen.poll keeps the exit code for torch's own poll.)"""
        handlers = getattr(self._pcontext, "subprocess_handlers", {})
        if not any(handler.proc.poll() not in (None, 0) for handler in handlers.values()):
            return []
        stopped = []
        for worker in worker_group.workers:
            handler = handlers.get(worker.local_rank)
            if handler is not None and process_state(handler.proc.pid) in STOPPED:
                kill(handler.proc.pid)
                stopped.append(worker.global_rank)
        return sorted(stopped)

    def _restart_workers(self, worker_group) -> None:
        cause = root_cause(self.failures_of(self.last_failure))
        self.restarts_done += 1
        self.on_restart(cause, self.restarts_done, worker_group.spec.max_restarts, self.stopped_ranks)
        self.stopped_ranks = []  # of the attempt that ended
        super()._restart_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._pcontext:
            for pid in self._pcontext.pids().values():
                if process_state(pid) in STOPPED:
                    kill(pid)
        if "timeout" in inspect.signature(super()._shutdown).parameters:
            super()._shutdown(death_sig, timeout)
        else:  # torch 2.11: _shutdown(death_sig) alone
            super()._shutdown(death_sig)


def launch(*, nnodes: int, nproc: int, endpoint: str, run_id: str, max_restarts: int, logs_specs,
           log_folder: Path, on_restart: OnRestart, args: list[str]) -> tuple[RankAgent, list[RankFailure] | None]:
    """Start `python -u -m trainer.train ARGS` in `nproc` processes and wait for them (torch's
    launch_agent, less its metrics and events): the agent, and None when the ranks succeeded, else
    the failed ranks of the last attempt. Raises SignalException when the launcher gets SIGTERM,
    SIGINT, SIGHUP or SIGQUIT (the agent has stopped the ranks then)."""
    parameters = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=nnodes,
                                      max_nodes=nnodes)
    spec = WorkerSpec(role="rank", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-u", "-m", "trainer.train", *args),
                      rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters),
                      max_restarts=max_restarts, monitor_interval=0.1)
    agent = RankAgent(spec=spec, logs_specs=logs_specs, start_method="spawn",
                      log_line_prefix_template="[rank${rank}]:",  # the global rank (torchrun's: the local one)
                      log_folder=log_folder, on_restart=on_restart)
    result = agent.run()
    spec.rdzv_handler.shutdown()
    return agent, agent.failures_of(result) if result.is_failed() else None
