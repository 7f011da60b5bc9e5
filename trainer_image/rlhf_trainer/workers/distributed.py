"""Process groups inside Ray actors: one per model group (DeepSpeed), gloo on CPU and NCCL on GPU."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

# A rank that died leaves the others blocked in a collective; fail after this instead of
# DeepSpeed's default of half an hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend(use_gpu: bool) -> str:
    return "nccl" if use_gpu else "gloo"


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, use_gpu: bool) -> None:
    """Join this group's default process group; DeepSpeed reads the same environment variables."""
    import deepspeed

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )
    if use_gpu:
        import torch

        torch.cuda.set_device(0)  # Ray gives each rank its own GPU as cuda:0
    deepspeed.init_distributed(dist_backend=backend(use_gpu), timeout=COLLECTIVE_TIMEOUT, verbose=False)
