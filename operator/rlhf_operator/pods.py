"""Why a starting Ray cluster is not up yet, in the words of the component that knows.

KubeRay's ReplicaFailure (it could not create a pod), the scheduler's PodScheduled=False (missing
PVC, no node with enough GPUs of that product, an untolerated taint...), the kubelet's waiting
reasons (image pull, container config). The first one found becomes the job's reason and message.
"""

from __future__ import annotations

from typing import Any

# Container waiting reasons that need a human (not the normal ContainerCreating).
STUCK_CONTAINER_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                           "CreateContainerError", "CrashLoopBackOff")
CLUSTER_LABEL = "ray.io/cluster"


def cluster_problem(ray_job: dict[str, Any]) -> tuple[str, str] | None:
    """KubeRay's ReplicaFailure condition, mirrored into the RayJob's rayClusterStatus."""
    cluster = ((ray_job.get("status") or {}).get("rayClusterStatus") or {})
    for condition in cluster.get("conditions") or []:
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return condition.get("reason") or "ReplicaFailure", f"KubeRay: {condition.get('message', '')}".strip()
    return None


def pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return condition.get("reason") or "Unschedulable", f"pod {name}: {condition.get('message', '')}"
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_CONTAINER_REASONS:
                return waiting["reason"], f"pod {name}, container {container['name']}: {waiting.get('message', '')}"
    return None
