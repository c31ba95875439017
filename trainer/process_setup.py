"""The process's runtime: device, backend, process group, seeds and determinism."""

from __future__ import annotations

import logging
import os
import platform
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.launch import rank_store

logger = logging.getLogger(__name__)


def pick_device(force_cpu: bool = False) -> torch.device:
    """CUDA device of this local rank when CUDA is there (and not force_cpu), else the CPU."""
    if torch.cuda.is_available() and not force_cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def software_and_device(device: torch.device) -> dict:
    """What a run's record says about where it ran: the device's name, and on CUDA the CUDA and
    NCCL versions torch was built with (None elsewhere)."""
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        return {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}
    return {"device_name": cpu_name(), "cuda": None, "nccl": None}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows of it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def backend_for(device: torch.device) -> str:
    # On CUDA, gloo still serves CPU tensors (e.g. checkpoint coordination).
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flight_recorder(config) -> tuple[int, str]:
    """(the NCCL flight recorder's entries, the path its dumps start with) of a job."""
    c = config.comm
    return c.trace_buf_size, os.path.join(config.job.dump_folder, c.save_traces_folder, c.save_traces_file_prefix)


def flight_recorder_env(trace_entries: int, dump_prefix: str) -> dict[str, str]:
    """The variables torch's NCCL flight recorder reads when a process group is created: how many
    collectives it keeps, and, when it keeps any, a dump of them on a timeout to files starting
    with `dump_prefix` (a folder and a file-name prefix; the rank is appended). Both names of each
    variable: torch renamed them (TORCH_FR_*) and reads either."""
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(trace_entries), "TORCH_FR_BUFFER_SIZE": str(trace_entries)}
    if trace_entries > 0:
        env.update(TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_NCCL_DEBUG_INFO_TEMP_FILE=dump_prefix,
                   TORCH_FR_DUMP_TEMP_FILE=dump_prefix)
    return env


def init_distributed(device: torch.device, timeout_s: int, nccl_trace_entries: int = 0,
                     trace_dump_prefix: str = "") -> tuple[int, int]:
    """Join (or, when started without torchrun, create) the process group; returns (rank, world size).
    A process that already joined one (several runs in one process group, as tests do) keeps it.
    On CUDA the NCCL flight recorder keeps `nccl_trace_entries` collectives and dumps them on a
    timeout to `trace_dump_prefix`<rank> (flight_recorder_env)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":  # the NCCL flight recorder reads these when the group is created
        for name, value in flight_recorder_env(nccl_trace_entries, trace_dump_prefix).items():
            os.environ.setdefault(name, value)
        if nccl_trace_entries > 0:
            os.makedirs(os.path.dirname(trace_dump_prefix) or ".", exist_ok=True)
    if "RANK" not in os.environ:  # a plain `python -m trainer.train` is a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    timeout = timedelta(seconds=timeout_s)
    # Started by this trainer's launcher: the store it hosts, else env:// (rank 0 opens one on MASTER_PORT).
    dist.init_process_group(backend=backend_for(device), timeout=timeout,
                            device_id=device if device.type == "cuda" else None, **rank_store.join(timeout))
    return dist.get_rank(), dist.get_world_size()


def set_collective_timeout(timeout_s: int, keep: tuple = ()) -> None:
    """Tighten the timeout of every process group of this rank once the slow first collectives
    (init, compile) are behind us; the groups in `keep` keep theirs.

    Training collectives run on the mesh's subgroups, not only on the default group, and each
    group carries its own timeout from its creation, so each is set. The barrier first lets every
    peer leave its slow first collectives under the long init timeout. Call it on every rank,
    after all groups exist: a group created later keeps the init timeout.
    """
    dist.barrier()
    timeout = timedelta(seconds=timeout_s)
    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):  # the groups this rank belongs to, the default one included
        if group is not c10d.GroupMember.NON_GROUP_MEMBER and group not in keep:
            c10d._set_pg_timeout(timeout, group)


def set_determinism(seed: int, deterministic: bool, warn_only: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        logger.info("deterministic algorithms enabled")
