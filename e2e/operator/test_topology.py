"""Topology-aware placement (spec.resources.topology) by the real Kueue's Topology-Aware Scheduling
(beta, on by default since Kueue v0.14) with the real KubeRay and kube-scheduler on kwok GPU nodes.

The module adds GPU nodes of a product of their own in one block of two racks, rack-1 with one node
and rack-2 with two, a Kueue Topology of block, rack and host, and a ResourceFlavor of those nodes
that names it: the queue's only flavor (untainted nodes, so the head and the submitter fit there too;
with a second flavor Kueue names only the last one tried when a job fits neither). Kueue admits a job's worker pod set to one rack and gates its pods until it has given
each the nodeSelector of its domain; the scheduler then places them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.controlplane import ControlPlane
from e2e.controlplane.kwok import KWOK_DIR
from e2e.controlplane.queues import API as KUEUE_API, CPU_QUOTA, GPU, MEMORY_QUOTA, PRODUCT_LABEL, cluster_queue, \
    delete_queues, local_queue
from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, touch_and_wait_reconciled, wait_phase
from rlhf_operator import kueue, names
from rlhf_operator.kube import Kube

PRODUCT = "E2E-TAS-GPU"
BLOCK, RACK, HOST = "e2e.rlhf.dev/topology-block", "e2e.rlhf.dev/topology-rack", "kubernetes.io/hostname"
RACKS = {"kwok-tas-0": "rack-1", "kwok-tas-1": "rack-2", "kwok-tas-2": "rack-2"}
TOPOLOGY = "e2e-racks"
FLAVOR = "e2e-tas-gpu"
GPUS_PER_NODE = 8
TIMEOUT = 120  # KubeRay, Kueue, kwok and the operator share two busy cores


def tas_nodes() -> list[dict[str, Any]]:
    """kwok GPU nodes like the H100 node of e2e/kwok/nodes.yaml, of PRODUCT, labelled with block and rack,
    without its taint."""
    template = next(node for node in yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text())
                    if node["metadata"]["labels"].get(PRODUCT_LABEL))
    nodes = []
    for index, (name, rack) in enumerate(RACKS.items()):
        node = copy.deepcopy(template)
        node["metadata"]["name"] = name
        del node["spec"]
        node["metadata"]["labels"] |= {HOST: name, PRODUCT_LABEL: PRODUCT, BLOCK: "block-a", RACK: rack}
        node["status"]["addresses"] = [{"type": "InternalIP", "address": f"10.0.1.{index + 1}"},
                                       {"type": "Hostname", "address": name}]
        nodes.append(node)
    return nodes


@pytest.fixture(scope="module")
def topology(kueue: ControlPlane) -> Iterator[None]:
    """The nodes, the Topology and the ResourceFlavor of this module (removed after it)."""
    api = kueue.api
    for node in tas_nodes():
        api.request("POST", "/api/v1/nodes", node, ok=(201, 409))
    api.request("POST", f"/apis/{KUEUE_API}/topologies", {
        "apiVersion": KUEUE_API, "kind": "Topology", "metadata": {"name": TOPOLOGY},
        "spec": {"levels": [{"nodeLabel": BLOCK}, {"nodeLabel": RACK}, {"nodeLabel": HOST}]}}, ok=(201, 409))
    api.request("POST", f"/apis/{KUEUE_API}/resourceflavors", {
        "apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
        "spec": {"nodeLabels": {PRODUCT_LABEL: PRODUCT}, "topologyName": TOPOLOGY}}, ok=(201, 409))
    try:
        yield
    finally:
        api.request("DELETE", f"/apis/{KUEUE_API}/resourceflavors/{FLAVOR}", ok=(200, 404))
        api.request("DELETE", f"/apis/{KUEUE_API}/topologies/{TOPOLOGY}", ok=(200, 404))
        for name in RACKS:
            api.request("DELETE", f"/api/v1/nodes/{name}", ok=(200, 404))


@pytest.fixture
def tas_queue(kueue: ControlPlane, topology: None, namespace: str) -> Iterator[str]:
    """A LocalQueue whose ClusterQueue has the topology's flavor alone, with more GPUs than its nodes hold
    (only the topology stops a job)."""
    local, cluster = "tas", f"{namespace}-tas"
    queue = cluster_queue(cluster, {})
    queue["spec"]["resourceGroups"][0]["flavors"] = [{"name": FLAVOR, "resources": [
        {"name": "cpu", "nominalQuota": CPU_QUOTA}, {"name": "memory", "nominalQuota": MEMORY_QUOTA},
        {"name": GPU, "nominalQuota": str(10 * GPUS_PER_NODE * len(RACKS))}]}]
    kueue.api.request("POST", f"/apis/{KUEUE_API}/clusterqueues", queue, ok=(201,))
    kueue.api.request("POST", f"/apis/{KUEUE_API}/namespaces/{namespace}/localqueues",
                      local_queue(namespace, local, cluster), ok=(201,))
    try:
        yield local
    finally:
        delete_queues(kueue.api, namespace, local, cluster)


def rack_job(name: str, queue: str, workers: int) -> dict[str, Any]:
    return rlhf_job(name, queueName=queue, resources={
        "nodes": workers, "gpusPerNode": GPUS_PER_NODE, "gpuProduct": PRODUCT, "topology": {"level": RACK}})


def worker_pods(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return kube.list("Pod", namespace, f"rlhf.dev/job={name},ray.io/node-type=worker")


def test_workers_asking_for_one_rack_are_placed_in_one_rack(kube, namespace, operator, tas_queue):
    operator.start()
    create_job(kube, namespace, rack_job("one-rack", tas_queue, workers=2))

    def placed() -> list[dict[str, Any]] | None:
        pods = worker_pods(kube, namespace, "one-rack")
        return pods if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) else None

    pods = wait_for(placed, TIMEOUT, "both worker pods of one-rack to be scheduled")
    nodes = sorted(p["spec"]["nodeName"] for p in pods)
    # Only rack-2 holds two such nodes: spread over both racks would have fitted the scheduler as well.
    assert nodes == ["kwok-tas-1", "kwok-tas-2"], nodes
    for pod in pods:
        # Kueue's assignment, as the nodeSelector of the pod's domain; its scheduling gate is lifted.
        assert pod["spec"]["nodeSelector"].get(HOST) == pod["spec"]["nodeName"], pod["spec"]["nodeSelector"]
        assert not pod["spec"].get("schedulingGates")
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == RACK


def test_workers_that_fit_in_no_rack_stay_queued_with_kueue_s_reason(kube, namespace, operator, tas_queue):
    operator.start()
    create_job(kube, namespace, rack_job("too-big", tas_queue, workers=3))
    wait_phase(kube, namespace, "too-big", "Suspended", "Queued", timeout=TIMEOUT)
    waiting = wait_for(lambda: kueue.waiting_reason(kueue.workload(kube, kube.get(
        "RayJob", namespace, names.ray_job("too-big")))), TIMEOUT, "Kueue's reason for not admitting too-big")
    assert f'topology "{TOPOLOGY}" allows to fit only 2 out of 3 pod(s)' in waiting[1], waiting
    # The operator watches no Workload: its next reconcile (an event of the job, or the resync) reads the reason.
    touch_and_wait_reconciled(kube, namespace, "too-big")
    assert waiting[1] in get_job(kube, namespace, "too-big")["status"]["message"]
    assert not worker_pods(kube, namespace, "too-big")
