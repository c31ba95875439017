"""The store where a job's ranks meet to form their process group, hosted by the launcher.

With `env://`, rank 0 opens this store itself on MASTER_PORT, a port that torch's agent found
free (it binds port 0, reads the number, closes the socket) before it started the ranks. In the
seconds between, any other process on the machine may take that port: a gloo pair's listening
socket, a client's outgoing connection, another job. Rank 0 then dies with EADDRINUSE ("The server
socket has failed to listen"), and the job fails, or spends one of its automatic restarts.

So the launcher of node 0 opens the store itself, on a port the kernel gives it when it listens (no
gap to lose it in), before the ranks start, and once per attempt: a restarted attempt must not
find the keys of the ranks that died (gloo would connect to their addresses). The other nodes'
launchers read its port from the rendezvous of the round. The ranks join it as clients (`join`)
when RANK_STORE_ENV names their MASTER_ADDR:MASTER_PORT; ranks started by torchrun keep `env://`
(a value inherited from another job names another port).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

RANK_STORE_ENV = "TRAINER_RANK_STORE"  # ADDRESS:PORT of the store the ranks' launcher hosts
PORT_KEY = "trainer_rank_store_port"  # in the rendezvous store of the round, for the other nodes
HOST_TIMEOUT = timedelta(minutes=5)  # the node-0 launcher's own calls to the store it hosts


def host(rendezvous_store: dist.Store, group_rank: int, address: str) -> tuple[dist.TCPStore | None, int]:
    """(the store this node hosts, None on the other nodes; its port), named in this process's
    environment for the ranks it starts next. Node 0 opens a fresh store and publishes its port in
    the round's rendezvous store; the other nodes wait for it there."""
    if group_rank == 0:
        store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=HOST_TIMEOUT)
        port = store.port
        rendezvous_store.set(PORT_KEY, str(port))
    else:
        store, port = None, int(rendezvous_store.get(PORT_KEY))
    os.environ[RANK_STORE_ENV] = f"{address}:{port}"
    return store, port


def join(timeout: timedelta) -> dict:
    """The arguments of `init_process_group` that join the launcher's store as a client, when this
    rank's launcher hosts one; else none (env://)."""
    if os.environ.get(RANK_STORE_ENV) != f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}":
        return {}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return {"store": store, "rank": rank, "world_size": world_size}
