"""A job's pods on nodes a user's cluster really has: every node tainted, a volume that is not there.
The real KubeRay operator makes the pods, the real scheduler places them on kwok nodes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, rlhf_job, wait_events, wait_phase

CPU_NODE = "kwok-cpu-0"
DEDICATED = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}


def pods(kube, namespace: str, job: str, role: str) -> list[dict]:
    return kube._request("GET", f"/api/v1/namespaces/{namespace}/pods",
                         query=[("labelSelector", f"rlhf.dev/job={job},rlhf.dev/role={role}")])["items"]


def scheduled(kube, namespace: str, job: str, role: str) -> dict | None:
    return next((p for p in pods(kube, namespace, job, role) if p["spec"].get("nodeName")), None)


@pytest.fixture
def every_node_tainted(kube, kwok_nodes) -> Iterator[None]:
    """The CPU node tainted too (the GPU nodes carry nvidia.com/gpu already), restored afterwards."""
    node = kube._request("GET", f"/api/v1/nodes/{CPU_NODE}")
    before = node["spec"].get("taints")
    kube._request("PATCH", f"/api/v1/nodes/{CPU_NODE}", {"spec": {"taints": [*(before or []), DEDICATED]}},
                  content_type="application/merge-patch+json")
    try:
        yield
    finally:
        kube._request("PATCH", f"/api/v1/nodes/{CPU_NODE}", {"spec": {"taints": before}},
                      content_type="application/merge-patch+json")


def test_on_a_cluster_whose_every_node_is_tainted_the_head_and_submitter_run(
        kube, namespace, kuberay_operator, every_node_tainted, operator):
    """The head (and KubeRay's submitter) used to get no tolerations: such a job never started."""
    operator.start()
    create_job(kube, namespace, rlhf_job("tainted", resources={"tolerations": [{**DEDICATED, "operator": "Equal"}]}))
    head = wait_for(lambda: scheduled(kube, namespace, "tainted", "head"), 120, "the head pod to be scheduled")
    assert head["spec"]["nodeName"] == CPU_NODE
    # KubeRay submits once the cluster is ready (kwok marks the pods running): its submitter pod
    # carries our template, tolerations included.
    submitter = wait_for(lambda: scheduled(kube, namespace, "tainted", "submitter"), 120, "the submitter pod")
    assert submitter["spec"]["nodeName"] == CPU_NODE


def test_a_missing_volume_is_the_reason_the_job_gives(kube, namespace, kuberay_operator, operator):
    """The status used to say only "waiting for its pods to be scheduled and ready"."""
    operator.start()
    create_job(kube, namespace, rlhf_job("nopvc", checkpoint={"pvc": "rlhf-checkpoints"}))
    status = wait_phase(kube, namespace, "nopvc", "Provisioning", "Unschedulable", timeout=120)["status"]
    assert 'persistentvolumeclaim "rlhf-checkpoints" not found' in status["message"]
    assert status["message"].startswith("Starting Ray cluster")
    # One event per message: the head's and a worker's scheduler verdicts may be worded apart.
    warnings = wait_events(kube, namespace, "nopvc", lambda e: e["reason"] == "Unschedulable", "the Unschedulable event")
    assert all(w["type"] == "Warning" and "rlhf-checkpoints" in w["message"] for w in warnings), warnings
