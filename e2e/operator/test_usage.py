"""GPU- and CPU-seconds in status.usage, with the real KubeRay operator, scheduler and kwok GPU nodes:
the run's usage equals the sum over its Ray pods of their running time (status.startTime to deletion)
times their requests, across a worker deleted while no operator ran and a second attempt (a new Ray
cluster after a suspend and resume).

Every pod is held by a finalizer of the test's once it runs, so its deletionTimestamp (the end both
the operator and the test read) stays on the object until the test has read it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest
from kubernetes.utils import parse_quantity

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from rlhf_api import v1alpha1 as api
from rlhf_operator import lifecycle

HOLD = "e2e.rlhf.dev/hold"
GPUS = 2
TIMEOUT = 120
PRICE = {"NVIDIA-H100-80GB-HBM3": 4.0, "NVIDIA-A100-SXM4-80GB": 2.0}  # per GPU-hour
PRICES = [arg for product, price in PRICE.items() for arg in ("--gpu-hour-price", f"{product}={price}")]


class Pods:
    """The job's Ray pods, each held once running; the last copy of each read while it existed."""

    def __init__(self, kube, namespace: str, job: str):
        self.kube, self.namespace, self.job = kube, namespace, job
        self.seen: dict[str, dict] = {}

    def current(self) -> list[dict]:
        return self.kube._request("GET", f"/api/v1/namespaces/{self.namespace}/pods", query=[
            ("labelSelector", f"rlhf.dev/job={self.job},ray.io/cluster")])["items"]

    def _patch(self, name: str, finalizers: list[str]) -> None:
        self.kube._request("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                           {"metadata": {"finalizers": finalizers}}, content_type="application/merge-patch+json")

    def hold_running(self, cluster: str, count: int) -> list[dict]:
        """The cluster's running pods once there are `count` (each held) and each has run into a later second
        than its start by the API server's clock, else None. Every pod then runs for at least one whole
        second (the stamps have a second's resolution), so each term of the usage is non-zero however fast
        kwok and the machine are."""
        found = [p for p in self.current() if p["metadata"]["labels"]["ray.io/cluster"] == cluster
                 and (p.get("status") or {}).get("startTime") and not p["metadata"].get("deletionTimestamp")]
        for pod in found:
            if HOLD not in (pod["metadata"].get("finalizers") or []):
                self._patch(pod["metadata"]["name"], [HOLD])
            self.seen[pod["metadata"]["name"]] = pod
        if len(found) != count:
            return None
        now = self.server_clock()
        return found if all(now > lifecycle.parse(p["status"]["startTime"]) for p in found) else None

    def server_clock(self) -> datetime:
        """The API server's time to the second: the creationTimestamp it gives a dry-run ConfigMap."""
        made = self.kube._request("POST", f"/api/v1/namespaces/{self.namespace}/configmaps",
                                  {"metadata": {"generateName": "clock-"}}, query=[("dryRun", "All")])
        return lifecycle.parse(made["metadata"]["creationTimestamp"])

    def delete(self, name: str) -> None:
        self.kube._request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", {"gracePeriodSeconds": 0})

    def ended(self, names: list[str]) -> bool:
        """Each of these pods has its final deletionTimestamp (now or past: kwok shortened the grace
        period of a graceful deletion) and the operator has recorded its end; those copies kept, and the
        pods let go. Let go before the operator saw the final copy, a pod would vanish from its view
        with its end unknown (a watch that restarts sees no DELETED event), and be closed at the time it
        was last counted running: a second or so off, under load (cpuSeconds 58 against 54 once)."""
        now = lifecycle.now()
        pods = {p["metadata"]["name"]: p for p in self.current()}
        if not all(name in pods and pods[name]["metadata"].get("deletionTimestamp") and
                   lifecycle.parse(pods[name]["metadata"]["deletionTimestamp"]) <= now for name in names):
            return False
        closed = records(self.kube, self.namespace)
        if not all(closed.get(name, {}).get("endTime") for name in names):
            return False
        for name in names:
            self.seen[name] = pods[name]
            self._patch(name, [])
        return True

    def release_all(self) -> None:
        for pod in self.current():
            if HOLD in (pod["metadata"].get("finalizers") or []):
                self._patch(pod["metadata"]["name"], [])


@pytest.fixture
def ray_pods(kube, namespace) -> Iterator[Pods]:
    pods = Pods(kube, namespace, "usage")
    try:
        yield pods
    finally:
        pods.release_all()


def requested(pod: dict, resource: str) -> float:
    """What the scheduler counts: the containers' requests, or an init container's if that is more
    (KubeRay's wait-gcs-ready on workers; Ray pods have no sidecars or overhead)."""
    def request(container: dict) -> float:
        return float(parse_quantity(container["resources"].get("requests", {}).get(resource, "0")))

    init = pod["spec"].get("initContainers") or []
    assert not pod["spec"].get("overhead") and not any(c.get("restartPolicy") for c in init)
    return max([sum(map(request, pod["spec"]["containers"])), *map(request, init)])


def running_seconds(pod: dict) -> int:
    return round((lifecycle.parse(pod["metadata"]["deletionTimestamp"])
                  - lifecycle.parse(pod["status"]["startTime"])).total_seconds())


def product(kube, pod: dict) -> str | None:
    """The GPU product of the pod's node; None for a pod without GPUs."""
    if not requested(pod, "nvidia.com/gpu"):
        return None
    return kube._request("GET", f"/api/v1/nodes/{pod['spec']['nodeName']}")["metadata"]["labels"]["nvidia.com/gpu.product"]


def usage(kube, namespace: str) -> dict:
    return (get_job(kube, namespace, "usage").get("status") or {}).get("usage") or {}


def records(kube, namespace: str) -> dict[str, dict]:
    return {p["name"]: p for a in usage(kube, namespace).get("attempts", []) for p in a["pods"]}


def cluster(kube, namespace: str, other_than: str = "") -> str:
    def new() -> str | None:
        name = ((kube.get("RayJob", namespace, "usage") or {}).get("status") or {}).get("rayClusterName")
        return name if name and name != other_than else None
    return wait_for(new, TIMEOUT, "a Ray cluster for the job")


def suspend(kube, namespace: str, pods: Pods, held: list[dict], on: bool) -> None:
    kube.patch(api.KIND, namespace, "usage", {"spec": {"suspend": on}})
    if on:
        wait_for(lambda: pods.ended([p["metadata"]["name"] for p in held]), TIMEOUT, "the cluster's pods to be deleted")
        wait_phase(kube, namespace, "usage", "Suspended", "Suspended", timeout=TIMEOUT)


def test_usage_is_the_pods_running_time_times_their_requests_across_a_restart_and_a_retry(
        kube, namespace, kuberay_operator, operator, ray_pods):
    operator.start(*PRICES)
    create_job(kube, namespace, rlhf_job("usage", resources={"gpusPerNode": GPUS}))
    first = cluster(kube, namespace)
    head, worker = sorted(wait_for(lambda: ray_pods.hold_running(first, 2), TIMEOUT, "the head and worker running"),
                          key=lambda p: p["metadata"]["labels"]["ray.io/node-type"] != "head")
    assert requested(worker, "nvidia.com/gpu") == GPUS and requested(head, "nvidia.com/gpu") == 0
    wait_for(lambda: records(kube, namespace).keys() == {head["metadata"]["name"], worker["metadata"]["name"]},
             60, "both pods in status.usage")

    # The worker is deleted while no operator runs, and stays terminating (KubeRay replaces it once it is gone).
    operator.kill()
    old = worker["metadata"]["name"]
    ray_pods.delete(old)
    operator.start(*PRICES)
    wait_for(lambda: records(kube, namespace)[old].get("endTime"), 60, "the old worker's end in status.usage")
    wait_for(lambda: ray_pods.ended([old]), TIMEOUT, "the old worker's deletion")
    wait_for(lambda: ray_pods.hold_running(first, 2), TIMEOUT, "a new worker")
    wait_for(lambda: len(records(kube, namespace)) == 3, 60, "the new worker in status.usage")

    # A second attempt: a new Ray cluster after a suspend and a resume; then the end of it.
    suspend(kube, namespace, ray_pods, [p for p in ray_pods.current() if p["metadata"]["labels"]["ray.io/cluster"] == first], True)
    suspend(kube, namespace, ray_pods, [], False)
    second = cluster(kube, namespace, other_than=first)
    held = wait_for(lambda: ray_pods.hold_running(second, 2), TIMEOUT, "the second attempt's pods running")
    suspend(kube, namespace, ray_pods, held, True)

    pods = list(ray_pods.seen.values())
    assert len(pods) == 5
    gpu_seconds = sum(running_seconds(p) * requested(p, "nvidia.com/gpu") for p in pods)
    cpu_seconds = sum(running_seconds(p) * requested(p, "cpu") for p in pods)
    assert gpu_seconds >= 3 * GPUS  # three GPU workers, each held running for at least a second
    cost = sum(running_seconds(p) * requested(p, "nvidia.com/gpu") / 3600 * PRICE.get(product(kube, p), 0) for p in pods)

    def counted() -> dict | None:
        found = usage(kube, namespace)
        closed = all(p.get("endTime") for a in found.get("attempts", []) for p in a["pods"])
        return found if closed and len(records(kube, namespace)) == 5 else None

    final = wait_for(counted, 60, "every pod's end in status.usage")
    assert (final["gpuSeconds"], final["cpuSeconds"]) == (gpu_seconds, cpu_seconds), (final, pods)
    assert [a["rayClusterName"] for a in final["attempts"]] == [first, second]
    assert sum(a["gpuSeconds"] for a in final["attempts"]) == gpu_seconds
    assert final["gpuHours"] == round(gpu_seconds / 3600, 2)
    assert final["estimatedCost"] == pytest.approx(cost, abs=1e-3)
    series = f'rlhf_job_gpu_seconds_total{{rlhf_job="usage",rlhf_namespace="{namespace}"}} {float(gpu_seconds)}'
    wait_for(lambda: series in operator.metrics(), 30, "the GPU-seconds counter")
    print(f"usage: {final['gpuSeconds']} GPU-seconds, {final['cpuSeconds']} CPU-seconds over "
          f"{[len(a['pods']) for a in final['attempts']]} pods per attempt")
