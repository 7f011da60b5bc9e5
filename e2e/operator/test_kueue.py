"""Queued RLHFJobs with the real operator, the real KubeRay and the real Kueue.

What is tested is Kueue's admission by quota, the RayCluster KubeRay makes for an admitted job,
and suspend/resume through the job's Workload. The jobs' pods are kept Pending (a node selector
no node has): kwok would run the submitter pod to completion, and 30 s later KubeRay fails a
RayJob whose Ray job never answered (DefaultSubmitterFinishedTimeout), which ends its Workload
and frees its quota in the middle of a test.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, touch_and_wait_reconciled, wait_phase
from rlhf_api import v1alpha1 as api
from rlhf_operator import kueue
from rlhf_operator.kube import Kube

H100 = "NVIDIA-H100-80GB-HBM3"
GPUS_PER_JOB = 8
NOWHERE = {"e2e.rlhf.dev/no-such-node": "true"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# A bound: KubeRay, Kueue, kwok and the operator share two busy cores. A first admission at the suite's start,
# four control planes starting beside it, once did not come within 120 s (wait_admitted now says what Kueue had
# made of the job when it times out).
TIMEOUT = 180


def gpu_job(name: str, queue: str) -> dict[str, Any]:
    return rlhf_job(name, queueName=queue, resources={
        "gpusPerNode": GPUS_PER_JOB, "nodes": 1, "gpuProduct": H100, "nodeSelector": NOWHERE})


def suspended(kube: Kube, namespace: str, name: str) -> bool | None:
    """The RayJob's spec.suspend (KubeRay omits false); None while there is no RayJob."""
    found = kube.get("RayJob", namespace, name)
    return None if found is None else bool(found["spec"].get("suspend"))


def ray_job(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    found = kube.get("RayJob", namespace, name)
    assert found is not None, f"RayJob {name} is gone"
    return found


def workload(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return wait_for(lambda: kueue.workload(kube, ray_job(kube, namespace, name)), TIMEOUT,
                    f"Kueue's Workload of {name}")


def clusters_of(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The RayClusters the RayJob `name` owns now."""
    uid = ray_job(kube, namespace, name)["metadata"]["uid"]
    found = kube._request("GET", f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters")["items"]
    return [c for c in found if any(o["uid"] == uid for o in c["metadata"].get("ownerReferences", []))]


def kueue_view(kube: Kube, namespace: str, name: str) -> str:
    """What Kueue made of the job `name`: its RayJob's suspend flag and queue, its Workload's conditions, and
    the conditions of the queues it names (for a test's failure message)."""
    found = kube.get("RayJob", namespace, name)
    if found is None:
        return "no RayJob"
    queue = found["metadata"].get("labels", {}).get(QUEUE_LABEL)
    made = kueue.workload(kube, found)
    lines = [f"RayJob suspend={found['spec'].get('suspend')} queue={queue}",
             f"Workload: {made.get('status', {}).get('conditions') if made else 'none'}"]
    if queue is None:
        return "\n".join(lines)
    api = f"/apis/{kueue.GROUP}/{kueue.served_version(kube)}"
    local = kube._request("GET", f"{api}/namespaces/{namespace}/localqueues/{queue}")
    cluster = kube._request("GET", f"{api}/clusterqueues/{local['spec']['clusterQueue']}")
    for kind, obj in (("LocalQueue", local), ("ClusterQueue", cluster)):
        lines.append(f"{kind}: {obj.get('status', {}).get('conditions')}")
    return "\n".join(lines)


def wait_admitted(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """Kueue unsuspended the RayJob and KubeRay made its cluster; returns that cluster."""
    try:
        wait_for(lambda: suspended(kube, namespace, name) is False, TIMEOUT, f"Kueue to admit {name}")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{kueue_view(kube, namespace, name)}") from None
    return wait_for(lambda: clusters_of(kube, namespace, name), TIMEOUT,
                    f"KubeRay to create the RayCluster of {name}")[0]


class RayClustersSeen:
    """Uids of every RayCluster that existed in the namespace while watched (a cluster that lived
    for a moment counts too): the number of cluster creations."""

    def __init__(self, kube: Kube, namespace: str):
        self.api, self.namespace = client.CustomObjectsApi(kube.api_client), namespace
        self.uids: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RayClustersSeen:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        version = None
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(
                        self.api.list_namespaced_custom_object, "ray.io", "v1", self.namespace,
                        "rayclusters", resource_version=version, timeout_seconds=2):
                    meta = event["object"]["metadata"]
                    self.uids.add(meta["uid"])
                    version = meta["resourceVersion"]
            except ApiException as error:
                if error.status != 410:  # 410: history compacted, list afresh
                    raise
                version = None


def test_quota_for_two_jobs_admits_two_and_the_third_when_one_goes(kube, namespace, operator, kueue_queues):
    queue = kueue_queues({H100: 2 * GPUS_PER_JOB})
    operator.start()
    for name in ("first", "second"):
        create_job(kube, namespace, gpu_job(name, queue))
    for name in ("first", "second"):
        wait_admitted(kube, namespace, name)

    create_job(kube, namespace, gpu_job("third", queue))
    queued = wait_phase(kube, namespace, "third", "Suspended", "Queued", timeout=TIMEOUT)
    assert suspended(kube, namespace, "third") is True
    assert not clusters_of(kube, namespace, "third")
    # The operator tells why in Kueue's words: the Workload's QuotaReserved=False message.
    waiting = wait_for(lambda: kueue.waiting_reason(workload(kube, namespace, "third")), TIMEOUT,
                       "Kueue's reason for not admitting the third job")
    assert "insufficient unused quota for nvidia.com/gpu" in waiting[1], waiting
    wait_for(lambda: waiting[1] in get_job(kube, namespace, "third")["status"]["message"], TIMEOUT,
             f"the third job's message to carry Kueue's reason {waiting[1]!r} (it said "
             f"{queued['status']['message']!r})")

    first = get_job(kube, namespace, "first")
    kube.delete(api.KIND, namespace, "first", first["metadata"]["uid"])
    wait_admitted(kube, namespace, "third")
    assert suspended(kube, namespace, "second") is False


def test_a_stage_waiting_for_its_input_holds_no_quota(kube, namespace, operator, kueue_queues):
    """A pipeline's stage whose input has not Succeeded (here: does not exist yet) makes no RayJob, so Kueue
    has no Workload of it: a job that needs the whole quota is admitted beside it."""
    queue = kueue_queues({H100: GPUS_PER_JOB})
    operator.start()
    stage = gpu_job("stage", queue)
    stage["spec"]["models"]["actor"] = {"fromJob": {"name": "sft"}}
    create_job(kube, namespace, stage)
    wait_phase(kube, namespace, "stage", "Waiting", "WaitingForJob", timeout=TIMEOUT)
    create_job(kube, namespace, gpu_job("whole-quota", queue))
    wait_admitted(kube, namespace, "whole-quota")
    assert kube.get("RayJob", namespace, "stage") is None


def test_suspend_and_resume_of_an_admitted_job_make_one_new_cluster(kube, namespace, operator, kueue_queues):
    queue = kueue_queues({H100: GPUS_PER_JOB})
    operator.start()
    with RayClustersSeen(kube, namespace) as seen:
        create_job(kube, namespace, gpu_job("tiny", queue))
        wait_admitted(kube, namespace, "tiny")
        for _ in range(3):
            touch_and_wait_reconciled(kube, namespace, "tiny")
        assert len(seen.uids) == 1, "the admitted job's cluster was recreated"

        kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": True}})
        wait_for(lambda: not kueue.active(workload(kube, namespace, "tiny")), TIMEOUT,
                 "the operator to deactivate the Workload")
        wait_for(lambda: suspended(kube, namespace, "tiny") is True, TIMEOUT, "Kueue to suspend the RayJob")
        wait_for(lambda: not clusters_of(kube, namespace, "tiny"), TIMEOUT,
                 "KubeRay to delete the suspended job's cluster")
        wait_phase(kube, namespace, "tiny", "Suspended", "Suspended", timeout=TIMEOUT)
        for _ in range(3):
            touch_and_wait_reconciled(kube, namespace, "tiny")
            assert suspended(kube, namespace, "tiny") is True
            assert not clusters_of(kube, namespace, "tiny")
        assert len(seen.uids) == 1, "a suspended job got a cluster"

        kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": False}})
        wait_for(lambda: kueue.active(workload(kube, namespace, "tiny")), TIMEOUT,
                 "the operator to reactivate the Workload")
        cluster = wait_admitted(kube, namespace, "tiny")
        for _ in range(3):
            touch_and_wait_reconciled(kube, namespace, "tiny")
        assert [c["metadata"]["uid"] for c in clusters_of(kube, namespace, "tiny")] == [cluster["metadata"]["uid"]]
        assert len(seen.uids) == 2, f"resuming made {len(seen.uids) - 1} clusters, not one"


@pytest.mark.usefixtures("kueue")
def test_kueue_webhooks_suspend_and_validate_a_queued_ray_job(kube, namespace):
    """A RayJob created by hand with a queue label goes through Kueue's webhooks (called on their
    127.0.0.1 URL): the mutating one suspends it, the validating one refuses what Kueue cannot stop."""
    body = {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": "by-hand", "namespace": namespace, "labels": {QUEUE_LABEL: "no-such-queue"}},
        "spec": {"entrypoint": "python -c 'print(1)'", "shutdownAfterJobFinishes": True, "suspend": False,
                 "rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                     {"name": "ray-head", "image": "rayproject/ray:2.49.0",
                      "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}}}},
    }
    assert kube.create(body)["spec"]["suspend"] is True
    pending = wait_for(lambda: kueue.waiting_reason(workload(kube, namespace, "by-hand")), TIMEOUT,
                       "Kueue's reason for not admitting by-hand")
    assert "no-such-queue" in pending[1], pending

    body["metadata"]["name"] = "never-stops"
    body["spec"]["shutdownAfterJobFinishes"] = False
    try:
        kube.create(body)
    except ApiException as error:
        assert "vrayjob.kb.io" in error.body, error.body
    else:
        raise AssertionError("Kueue's validating webhook let a RayJob that keeps its cluster in")
