"""What an RLHFJob's pods held: GPU- and CPU-seconds per attempt and in total (status.usage).

Each pod of the job's Ray clusters (an attempt is one Ray cluster: KubeRay starts a new one for each
retry) is recorded when the operator sees it started (status.startTime) and closed when it stops
holding its resources: when its last container finished (every container terminated), else when
it was deleted (its deletionTimestamp, or the DELETED event as the operator saw it). The records
live in status, so retries and operator restarts keep them; the totals are recomputed from them on
every write, and a record once closed never changes, so seeing a pod again changes nothing.

A pod that went while no operator watched (its DELETED event never seen) is closed at the status's
countedUntil, the last time the operator counted it running: a lower bound, off by at most the
resync period (or by the operator's downtime). A pod that started and went while no operator ran is
not counted. Running pods count up to countedUntil, which each write moves to now; the resync
(reconcile.resync) writes for every job with a running pod.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from rlhf_api import v1alpha1 as api

from . import kube, lifecycle, names, pods

log = logging.getLogger(__name__)
# A pod event is not retried by kopf: a write given up on waits for the next event or resync (minutes), so
# conflicts are waited out. Two pods deleted together start two handlers that, re-reading at once, kept
# overtaking each other (and the status mirror) and both gave up within 20 ms: a jittered backoff
# (CONFLICT_BACKOFF_SECONDS doubling, capped at 1 s; at most 4.6 s in all) lets them take turns.
WRITE_ATTEMPTS = 8
CONFLICT_BACKOFF_SECONDS = 0.05
# GPU product -> price of one GPU-hour (`rlhf operator --gpu-hour-price`); empty: no cost estimate.
PRICES: dict[str, float] = {}


def pod_request(spec: dict[str, Any], resource: str) -> float:
    """A pod's request of a resource as the scheduler counts it (k8s resourcehelper.PodRequests): its
    containers' sum and its sidecars' (restartable init containers), or an init container's with the
    sidecars started before it if that is more, plus the pod's overhead."""
    def quantity(values: dict[str, Any] | None) -> float:
        return float(parse_quantity((values or {}).get(resource, "0")))

    def request(container: dict[str, Any]) -> float:
        return quantity((container.get("resources") or {}).get("requests"))

    sidecars = init = 0.0
    for container in spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":
            sidecars += request(container)
        else:
            init = max(init, sidecars + request(container))
    pod_level = (spec.get("resources") or {}).get("requests") or {}
    running = quantity(pod_level) if resource in pod_level else sum(map(request, spec.get("containers") or []))
    return max(running + sidecars, init) + quantity(spec.get("overhead"))


def _end(pod: dict[str, Any], now: str, deleted: bool) -> str | None:
    """When the pod stopped holding its resources; None while it holds them. A deletionTimestamp is
    when a graceful deletion will end at the latest (now + grace period; the kubelet, or kwok,
    shortens it as it kills the pod): in the future it is no end yet."""
    containers = (pod.get("status") or {}).get("containerStatuses") or []
    finished = [((c.get("state") or {}).get("terminated") or {}).get("finishedAt") for c in containers]
    if containers and all(finished):
        return max(finished, key=lifecycle.parse)
    deletion = pod["metadata"].get("deletionTimestamp")
    if deleted:
        return min(deletion or now, now, key=lifecycle.parse)
    return deletion if deletion and lifecycle.parse(deletion) <= lifecycle.parse(now) else None


def observe(pod: dict[str, Any], gpu_resource: str, now: str, deleted: bool = False) -> dict[str, Any] | None:
    """The pod's usage record (PodUsage) as the pod shows it now (deleted: in its DELETED event); None
    before it started."""
    started = (pod.get("status") or {}).get("startTime")
    if not started:
        return None
    spec = pod.get("spec") or {}
    seen = {"name": pod["metadata"]["name"], "gpus": round(pod_request(spec, gpu_resource)),
            "cpus": round(pod_request(spec, "cpu"), 3), "startTime": started}
    if PRICES and seen["gpus"] and spec.get("nodeName"):
        seen["gpuProduct"] = _gpu_product(spec["nodeName"])
    end = _end(pod, now, deleted)
    return {**seen, "endTime": end} if end else seen


def _gpu_product(node: str) -> str | None:
    found = kube.client().get("Node", "", node)
    return ((found or {}).get("metadata", {}).get("labels") or {}).get(names.GPU_PRODUCT_LABEL)


def with_pod(attempts: list[dict[str, Any]], cluster: str, seen: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts with this pod's record added, or its end added to its open record."""
    attempts = copy.deepcopy(attempts)
    attempt = next((a for a in attempts if a["rayClusterName"] == cluster), None)
    if attempt is None:
        attempt = {"rayClusterName": cluster, "pods": []}
        attempts.append(attempt)
    record = next((p for p in attempt["pods"] if p["name"] == seen["name"]), None)
    if record is None:
        attempt["pods"].append(seen)
    elif not record.get("endTime") and seen.get("endTime"):
        record["endTime"] = seen["endTime"]
    return sorted(attempts, key=lambda a: min(lifecycle.parse(p["startTime"]) for p in a["pods"]))


def without_vanished(attempts: list[dict[str, Any]], existing: set[str], until: str) -> list[dict[str, Any]]:
    """Open records of pods that no longer exist closed at `until` (countedUntil: last counted running)."""
    attempts = copy.deepcopy(attempts)
    for record in _open(attempts):
        if record["name"] not in existing:
            record["endTime"] = max(until, record["startTime"], key=lifecycle.parse)
    return attempts


def _open(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for a in attempts for p in a["pods"] if not p.get("endTime")]


def running(status: dict[str, Any] | None) -> bool:
    """Some pod of the job is counted as running."""
    return bool(_open(((status or {}).get("usage") or {}).get("attempts") or []))


def totals(attempts: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """status.usage from the records, running pods counted up to now."""
    gpu_seconds, cpu_seconds, cost = 0, 0.0, 0.0
    counted = []
    for attempt in attempts:
        a_gpu, a_cpu, a_cost = 0, 0.0, 0.0
        for pod in attempt["pods"]:
            seconds = max(0, round((lifecycle.parse(pod.get("endTime") or now)
                                    - lifecycle.parse(pod["startTime"])).total_seconds()))
            a_gpu += seconds * pod.get("gpus", 0)
            a_cpu += seconds * pod.get("cpus", 0)
            a_cost += seconds * pod.get("gpus", 0) / 3600 * PRICES.get(pod.get("gpuProduct") or "", 0.0)
        counted.append({**attempt, "gpuSeconds": a_gpu, "cpuSeconds": round(a_cpu, 3),
                        "estimatedCost": round(a_cost, 4) if PRICES else None})
        gpu_seconds, cpu_seconds, cost = gpu_seconds + a_gpu, cpu_seconds + a_cpu, cost + a_cost
    return {"gpuSeconds": gpu_seconds, "cpuSeconds": round(cpu_seconds, 3), "gpuHours": round(gpu_seconds / 3600, 2),
            "estimatedCost": round(cost, 4) if PRICES else None, "countedUntil": now, "attempts": counted}


def _write(body: dict[str, Any], change: Callable[[dict[str, Any]], list[dict[str, Any]]], tick: bool) -> None:
    """Write status.usage with the records `change` makes of the current ones, if they changed (or,
    with tick, if a pod runs: countedUntil moves); conditional on the resourceVersion read, re-read on
    a conflict (another pod's event, the trainer, the operator's phase write)."""
    client = kube.client()
    meta = body["metadata"]
    for attempt in range(WRITE_ATTEMPTS):
        usage = (body.get("status") or {}).get("usage") or {}
        before = usage.get("attempts") or []
        attempts = change(usage)
        if attempts == before and not (tick and _open(attempts)):
            return
        try:
            client.patch(api.KIND, meta["namespace"], meta["name"], {
                "metadata": {"resourceVersion": meta["resourceVersion"]},
                "status": {"usage": totals(attempts, lifecycle.timestamp(lifecycle.now()))}}, subresource="status")
            return
        except ApiException as error:
            if error.status == 404:
                return
            if error.status != 409:
                raise
        time.sleep(random.uniform(0, min(1.0, CONFLICT_BACKOFF_SECONDS * 2**attempt)))
        body = client.get(api.KIND, meta["namespace"], meta["name"])
        if body is None or body["metadata"]["uid"] != meta["uid"]:
            return
        meta = body["metadata"]
    log.info("RLHFJob %s/%s kept changing while its usage was written; the next event or resync writes it",
             meta["namespace"], meta["name"])


def on_pod_event(event_type: str | None, pod: dict[str, Any], job: dict[str, Any] | None) -> None:
    """A pod of one of our Ray clusters was seen (created, changed, deleted, or listed at startup)."""
    if job is None or lifecycle.parse(pod["metadata"]["creationTimestamp"]) < lifecycle.parse(
            job["metadata"]["creationTimestamp"]):
        return  # a same-named job that was deleted left it
    gpu_resource = job["spec"]["resources"]["gpuResourceName"]  # the API server defaults it
    seen = observe(pod, gpu_resource, lifecycle.timestamp(lifecycle.now()), deleted=event_type == "DELETED")
    if seen is None:
        return
    cluster = pod["metadata"]["labels"][pods.CLUSTER_LABEL]
    _write(job, lambda usage: with_pod(usage.get("attempts") or [], cluster, seen), tick=False)


def settle(body: dict[str, Any]) -> None:
    """Close the records of pods that are gone unseen, and count the running ones up to now."""
    if not running(body.get("status")):
        return
    meta = body["metadata"]
    existing = {p["metadata"]["name"] for p in kube.client().list(
        "Pod", meta["namespace"], f"{names.JOB_LABEL}={names.label_value(meta['name'])},{pods.CLUSTER_LABEL}")}

    def change(usage: dict[str, Any]) -> list[dict[str, Any]]:
        attempts = usage.get("attempts") or []
        return without_vanished(attempts, existing, usage.get("countedUntil") or lifecycle.timestamp(lifecycle.now()))

    _write(body, change, tick=True)
