"""Process groups inside Ray actors: one per model group (DeepSpeed), gloo on CPU and NCCL on GPU.

Each group's rendezvous is a TCPStore served by its rank 0 on a port the operating system picks
when the store binds it (`open_store`), so the port is held from the moment its address is handed
to the other ranks: no other process can take it in between, as it could a port found free and
released again.
"""

from __future__ import annotations

import os
from datetime import timedelta

from ..node_checks import check_gpu, check_locked_memory

# A rank that died leaves the others blocked in a collective; fail after this instead of
# DeepSpeed's default of half an hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend(use_gpu: bool) -> str:
    return "nccl" if use_gpu else "gloo"


# The weight sync's name for it (weight_sync.py): its NCCL group registers buffers with the adapters too.
require_locked_memory = check_locked_memory


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def open_store(world_size: int, timeout: timedelta):
    """Rank 0's side of a rendezvous: a TCPStore listening on every interface, on a port of its own.
    The other ranks join it at (node_address(), store.port) with `join_store`."""
    from torch import distributed

    return distributed.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def join_store(address: str, port: int, world_size: int, timeout: timedelta):
    from torch import distributed

    return distributed.TCPStore(address, port, world_size, is_master=False, timeout=timeout)


def init_distributed(rank: int, world_size: int, store, *, use_gpu: bool) -> None:
    """Join this group's default process group over `store` (open_store on rank 0, join_store on the
    others); DeepSpeed then takes the initialised group as its own. A process already in a group
    keeps it, as DeepSpeed's own init_distributed does."""
    import deepspeed
    import torch

    # DeepSpeed reads who this process is from the environment; the rendezvous is the store's.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    options = {}
    if use_gpu:  # before NCCL and any model: a node that cannot run the rank says so (NodeUnusable)
        check_gpu()
        check_locked_memory()
        torch.cuda.set_device(0)  # Ray gives each rank its own GPU as cuda:0
        if world_size > 1:  # bound to its device as DeepSpeed binds the groups it creates itself
            options["device_id"] = torch.device("cuda", 0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend(use_gpu), store=store, rank=rank, world_size=world_size,
                                             timeout=COLLECTIVE_TIMEOUT, **options)
    deepspeed.init_distributed(dist_backend=backend(use_gpu), timeout=COLLECTIVE_TIMEOUT, verbose=False,
                               auto_mpi_discovery=False)
