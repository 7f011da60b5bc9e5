"""How the actor's weights reach each vLLM worker, decided from the placement alone (pure: no Ray, no torch).

A bundle is one GPU (on CPU, one process's CPU), so two Ray actors on one bundle share its device
wherever Ray puts the bundle. NCCL refuses two ranks of one group on one device, so:

- a vLLM worker on a bundle that holds an actor rank (training.colocation: all) takes the weights
  from that rank through same-device handles: CUDA IPC on GPU, shared memory on CPU (`HANDLES`);
- every other worker is a rank of the broadcast group, whose rank 0 is actor rank 0 (`BROADCAST`);
  such a worker is on no actor bundle, and engines never share bundles, so no two ranks of that
  group share a device.

The weights travel in buckets: consecutive weights flattened into one tensor of at most
rollout.weightSyncBucketMib (`bucket_ranges`), one gather, one collective or handle per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

HANDLES, BROADCAST = "handles", "broadcast"


@dataclass(frozen=True)
class Route:
    engine: int
    worker: int  # the worker's rank inside its engine (its tensor-parallel rank)
    bundle: int  # its bundle, i.e. its device
    sender: int  # the actor rank that sends to it
    via: str  # HANDLES or BROADCAST
    sync_rank: int | None = None  # BROADCAST: its rank in the broadcast group (actor rank 0 is rank 0)


def plan_transfer(ranks: dict[str, list[int]], engine_width: int) -> list[Route]:
    """One route per vLLM worker, engine by engine; `ranks` and `engine_width` are a placement's
    (rlhf_api.planning.placement.Placement: role -> bundle of each rank, "rollout" -> first bundle of each engine)."""
    actor_rank_on = {bundle: rank for rank, bundle in enumerate(ranks["actor"])}
    routes: list[Route] = []
    members = 1  # actor rank 0
    for engine, first in enumerate(ranks.get("rollout", [])):
        for worker in range(engine_width):
            bundle = first + worker
            if bundle in actor_rank_on:
                routes.append(Route(engine, worker, bundle, actor_rank_on[bundle], HANDLES))
            else:
                routes.append(Route(engine, worker, bundle, 0, BROADCAST, members))
                members += 1
    return routes


def broadcast_bundles(ranks: dict[str, list[int]], routes: list[Route]) -> list[int]:
    """The bundle of each rank of the broadcast group, in rank order (just actor rank 0's when no
    worker receives by broadcast: the group is then not formed)."""
    return [ranks["actor"][0]] + [route.bundle for route in routes if route.via == BROADCAST]


def bucket_ranges(sizes: list[int], limit: int) -> list[range]:
    """Consecutive indices of `sizes` (bytes per weight) grouped so that no group exceeds `limit`
    bytes; a weight larger than `limit` travels alone (limit 0: every weight alone)."""
    buckets, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > limit:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    if sizes:
        buckets.append(range(start, len(sizes)))
    return buckets
