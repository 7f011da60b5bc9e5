"""Actor -> vLLM weight sync after every update.

CPU: every actor rank takes part in gathering the ZeRO-3 shards; rank 0 returns the full state
dict, Ray carries it (once, through the object store) to every engine, and each engine reloads it
in place with vLLM's `reload_weights` and drops its prefix cache (cached KV blocks were computed
with the old weights). Verified by tests/trainer/test_weight_sync.py.

GPU: actor rank 0 and every vLLM worker form one NCCL group of their own (vLLM's
StatelessProcessGroup + PyNcclCommunicator, so neither side's default group is touched); each
gathered parameter is broadcast from rank 0 and loaded by the workers.
UNTESTED: written for GPUs but never run, as the development machines have none.
"""

from __future__ import annotations

import ray
import torch


def sync_weights(actor_group, engines: list, *, dtype: str, use_gpu: bool) -> None:
    """Push the actor's current weights to every rollout engine and wait until they serve them."""
    if use_gpu:
        ray.get(actor_group.call("broadcast_weights", engines, dtype))
        ray.get([engine.reset_prefix_cache.remote() for engine in engines])  # after the last weight arrived
        return
    states = actor_group.call("state_dict", dtype)
    ray.get([engine.load_weights.remote(states[0]) for engine in engines] + states[1:])


# -- GPU: NCCL broadcast group (UNTESTED) --------------------------------------------------------


def setup_broadcast_group(actor_group, engines: list, tensor_parallel_size: int) -> None:
    """One NCCL group: actor rank 0 is rank 0, then the tensor-parallel workers of each engine."""
    master_addr, master_port = ray.get(actor_group.workers[0].master_address.remote())
    world_size = 1 + len(engines) * tensor_parallel_size
    receivers = [
        engine.init_weight_sync.remote(master_addr, master_port, 1 + i * tensor_parallel_size, world_size)
        for i, engine in enumerate(engines)
    ]
    ray.get([actor_group.workers[0].init_weight_sync.remote(master_addr, master_port, world_size)] + receivers)


def _communicator(master_addr: str, master_port: int, rank: int, world_size: int):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_addr, port=master_port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=torch.cuda.current_device())


def init_sender(master_addr: str, master_port: int, world_size: int):
    return _communicator(master_addr, master_port, 0, world_size)


def broadcast_parameters(model, sync_group, engines: list, dtype: torch.dtype) -> None:
    """Runs on every actor rank (the gather is collective); rank 0 broadcasts each parameter over
    its sync_group (init_sender's)."""
    from .weights import named_full_parameters  # here: vLLM's workers import this module for the extension

    for name, tensor in named_full_parameters(model, dtype):
        if model.rank == 0:
            dtype_name = str(dtype).removeprefix("torch.")
            received = [e.receive_weight.remote(name, dtype_name, tuple(tensor.shape)) for e in engines]
            sync_group.broadcast(tensor.contiguous(), src=0, stream=torch.cuda.current_stream())
            ray.get(received)


class WeightSyncExtension:
    """Mixed into vLLM's GPU worker (vLLM's `worker_extension_cls`): the receiving side."""

    def init_weight_sync(self, master_addr: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank + rank_offset
        self.weight_sync_group = _communicator(master_addr, master_port, rank, world_size)

    def receive_weight(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        weight = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
        self.weight_sync_group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        self.model_runner.get_model().load_weights(weights=[(name, weight)])

