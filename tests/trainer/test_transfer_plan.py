"""The weight-transfer plan of every example job, on one node of 8 GPUs and on two: no group that
runs collectives (a model group, a vLLM engine's tensor-parallel workers, the weight-sync broadcast
group) has two ranks on one device (NCCL refuses them), and exactly the vLLM workers on an actor
rank's device take the weights through handles, from that rank. `pytest -s` prints each plan."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from rlhf_api.planning.placement import ROLLOUT, plan_placement
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.workers.transfer_plan import BROADCAST, HANDLES, broadcast_bundles, bucket_ranges, plan_transfer
from rlhf_trainer.workers.weight_sync import engine_routes, worker_route

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
CLUSTERS = {"1x8": (1, 8), "2x8": (2, 8)}


def _job(example: str, nodes: int, gpus_per_node: int):
    """The example as the trainer reads it (rlhf_api.validation.validate), on `nodes` x `gpus_per_node` GPUs."""
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"]["resources"].update(nodes=nodes, gpusPerNode=gpus_per_node)
    return validate(manifest)


def _groups(placement, routes) -> dict[str, list[int]]:
    """The bundles of each group's ranks: every model group, every engine, the broadcast group."""
    groups = {role: bundles for role, bundles in placement.ranks.items() if role != ROLLOUT}
    for engine, first in enumerate(placement.ranks.get(ROLLOUT, [])):
        groups[f"engine {engine}"] = list(range(first, first + placement.engine_width))
    if routes:
        groups["broadcast"] = broadcast_bundles(placement.ranks, routes)
    return groups


def _table(example: str, cluster: str, placement, routes) -> str:
    """One line per engine worker: where it is and how its weights come."""
    head = f"{example} on {cluster}: {placement.bundles} GPUs used, " + "; ".join(
        f"{role} on GPUs {bundles}" for role, bundles in placement.ranks.items() if role != ROLLOUT)
    return "\n".join([head] + [
        f"  engine {r.engine} worker {r.worker} on GPU {r.bundle}: "
        + (f"handles from actor rank {r.sender}" if r.via == HANDLES else f"broadcast, rank {r.sync_rank} of the group")
        for r in routes])


def _fits(example: str, cluster: str):
    """The example's placement on the cluster, or None when the cluster is too small for it (validation
    or check_cluster refuses it there, telling the user so)."""
    nodes, gpus_per_node = CLUSTERS[cluster]
    try:
        job = _job(example, nodes, gpus_per_node)
        placement = plan_placement(job.spec, use_gpu=True)
    except InvalidJob:
        return None
    return (job, placement) if placement.bundles <= nodes * gpus_per_node else None


ALL_EXAMPLES = sorted(path.name for path in EXAMPLES.glob("*.yaml"))
PLANS = [(example, cluster) for example in ALL_EXAMPLES for cluster in CLUSTERS if _fits(example, cluster)]


def test_every_example_is_planned_on_a_cluster_it_fits():
    assert sorted({example for example, _ in PLANS}) == ALL_EXAMPLES


@pytest.mark.parametrize(("example", "cluster"), PLANS)
def test_no_collective_group_has_two_ranks_on_one_device(example, cluster):
    job, placement = _fits(example, cluster)
    online = ROLLOUT in placement.ranks and placement.ranks[ROLLOUT]  # an offline job syncs no weights
    routes = plan_transfer(placement.ranks, placement.engine_width) if online else []
    print(_table(example, cluster, placement, routes))

    for group, bundles in _groups(placement, routes).items():
        assert not [b for b, n in Counter(bundles).items() if n > 1], f"{group} has two ranks on one GPU: {bundles}"
    if not online:
        return
    actor = placement.ranks["actor"]
    workers = [(engine, worker) for engine in range(len(placement.ranks.get(ROLLOUT, [])))
               for worker in range(placement.engine_width)]
    assert [(r.engine, r.worker) for r in routes] == workers, "every vLLM worker has one route"
    for route in routes:
        assert (route.via == HANDLES) == (route.bundle in actor)
        assert route.via == BROADCAST or actor[route.sender] == route.bundle  # the rank on its own device
    if job.spec.training.colocation == "all":
        assert {r.via for r in routes} <= {HANDLES}
    else:
        assert {r.via for r in routes} <= {BROADCAST}


def test_a_worker_off_the_actors_devices_is_sent_to_by_broadcast_next_to_handles():
    """colocation all with fewer actor ranks than vLLM GPUs: the workers on actor GPUs take handles,
    the others join the broadcast group, each on a GPU of its own."""
    routes = plan_transfer({"actor": [0, 1], ROLLOUT: [0, 2]}, engine_width=2)
    assert [(r.bundle, r.via, r.sender, r.sync_rank) for r in routes] == [
        (0, HANDLES, 0, None), (1, HANDLES, 1, None), (2, BROADCAST, 0, 1), (3, BROADCAST, 0, 2)]
    assert broadcast_bundles({"actor": [0, 1]}, routes) == [0, 2, 3]


def test_buckets_hold_consecutive_weights_up_to_the_limit_and_a_larger_weight_alone():
    assert bucket_ranges([3, 3, 3, 10, 1, 1], limit=6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert bucket_ranges([3, 3], limit=0) == [range(0, 1), range(1, 2)]  # every weight alone
    assert bucket_ranges([], limit=6) == []


def test_each_worker_gets_its_route_through_vllm_s_message_encoding():
    """Out of process (vLLM's default, and always so on a GPU) collective_rpc's arguments reach the
    engine core as msgpack, which writes a dataclass as a plain map: the worker got a dict, and
    `route.via` raised AttributeError before any weight was sent."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    routes = plan_transfer({"actor": [0], ROLLOUT: [0, 1]}, engine_width=1)
    for engine, route in enumerate(routes):
        received = MsgpackDecoder().decode(MsgpackEncoder().encode(engine_routes(routes, engine)))
        assert worker_route(received, route.worker) == route
