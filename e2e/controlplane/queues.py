"""Kueue queues over the kwok nodes (e2e/kwok/nodes.yaml), for tests of queued jobs.

A ResourceFlavor per GPU product (nodeLabels nvidia.com/gpu.product, and the nodes' taints, so
that only pods tolerating them are counted against GPU flavors) and one for the CPU nodes; a
ClusterQueue with quota for cpu, memory and nvidia.com/gpu on those flavors; a LocalQueue in
a namespace pointing at it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from .client import Api
from .kwok import KWOK_DIR

API = "kueue.x-k8s.io/v1beta2"
PRODUCT_LABEL = "nvidia.com/gpu.product"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU = "nvidia.com/gpu"
CPU_FLAVOR = "cpu"
# Enough for the head and submitter pods of many small jobs: tests size GPUs, not these.
CPU_QUOTA, MEMORY_QUOTA = "1000", "10Ti"


def flavor_name(product: str) -> str:
    return product.lower()


def resource_flavors() -> list[dict[str, Any]]:
    """One ResourceFlavor per GPU product of the kwok nodes, and CPU_FLAVOR for the others."""
    flavors: dict[str, dict[str, Any]] = {}
    for node in yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text()):
        labels = node["metadata"]["labels"]
        product = labels.get(PRODUCT_LABEL)
        name, key = ((flavor_name(product), PRODUCT_LABEL) if product
                     else (CPU_FLAVOR, INSTANCE_TYPE_LABEL))
        spec: dict[str, Any] = {"nodeLabels": {key: labels[key]}}
        if taints := (node.get("spec") or {}).get("taints"):
            spec["nodeTaints"] = taints
        flavors[name] = spec
    return [{"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec}
            for name, spec in flavors.items()]


def cluster_queue(name: str, gpus: Mapping[str, int]) -> dict[str, Any]:
    """A ClusterQueue with `gpus[product]` GPUs of each product named (other products get none)
    and plenty of cpu and memory, on every flavor of resource_flavors()."""
    flavors = []
    for flavor in resource_flavors():
        product = flavor["spec"]["nodeLabels"].get(PRODUCT_LABEL)
        flavors.append({"name": flavor["metadata"]["name"], "resources": [
            {"name": "cpu", "nominalQuota": CPU_QUOTA},
            {"name": "memory", "nominalQuota": MEMORY_QUOTA},
            {"name": GPU, "nominalQuota": str(gpus.get(product, 0) if product else 0)},
        ]})
    return {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": ["cpu", "memory", GPU], "flavors": flavors}],
    }}


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue_name}}


def create_queues(api: Api, namespace: str, local: str, cluster: str,
                  gpus: Mapping[str, int]) -> None:
    """The flavors (kept if there), ClusterQueue `cluster` and LocalQueue `local` in namespace."""
    for flavor in resource_flavors():
        api.request("POST", f"/apis/{API}/resourceflavors", flavor, ok=(201, 409))
    api.request("POST", f"/apis/{API}/clusterqueues", cluster_queue(cluster, gpus), ok=(201,))
    api.request("POST", f"/apis/{API}/namespaces/{namespace}/localqueues",
                local_queue(namespace, local, cluster), ok=(201,))


def delete_queues(api: Api, namespace: str, local: str, cluster: str) -> None:
    """The queues of create_queues (Kueue lets them go once no Workload uses them)."""
    api.request("DELETE", f"/apis/{API}/namespaces/{namespace}/localqueues/{local}",
                ok=(200, 404))
    api.request("DELETE", f"/apis/{API}/clusterqueues/{cluster}", ok=(200, 404))
