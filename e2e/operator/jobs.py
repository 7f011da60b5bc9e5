"""RLHFJobs for the operator's end-to-end tests, and ways to look at what the operator made."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from urllib3.exceptions import ProtocolError

from e2e.fixtures import wait_for
from rlhf_api import v1alpha1 as api
from rlhf_operator.kube import Kube


def rlhf_job(name: str, **spec: Any) -> dict[str, Any]:
    """A small valid RLHFJob (SFT on CPU workers unless resources say otherwise)."""
    resources = {"gpusPerNode": 0, "head": {"cpu": "1", "memory": "1Gi"}, "worker": {"cpu": "1", "memory": "1Gi"},
                 "shmSize": "1Gi", **spec.pop("resources", {})}
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name},
        "spec": {
            "algorithm": "sft",
            "models": {"actor": {"path": "org/tiny-model"}},
            "data": {"sft": {"sources": [{"path": "org/tiny-data"}]}},
            "resources": resources,
            **spec,
        },
    }


def create_job(kube: Kube, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    job["metadata"]["namespace"] = namespace
    return kube.create(job)


def get_job(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    job = kube.get(api.KIND, namespace, name)
    assert job is not None, f"RLHFJob {name} is gone"
    return job


def wait_phase(kube: Kube, namespace: str, name: str, phase: str, reason: str | None = None,
               timeout: float = 60) -> dict[str, Any]:
    """The job once its status has that phase (and reason); fails with the last status seen."""
    def reached() -> dict[str, Any] | None:
        job = get_job(kube, namespace, name)
        status = job.get("status") or {}
        if status.get("phase") == phase and reason in (None, status.get("reason")):
            return job
        return None

    try:
        return wait_for(reached, timeout, f"RLHFJob {name} phase {phase} {reason or ''}")
    except AssertionError as error:
        raise AssertionError(f"{error}; status: {(get_job(kube, namespace, name).get('status'))}") from None


def events(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """Events about the RLHFJob, oldest first."""
    found = kube._request("GET", f"/api/v1/namespaces/{namespace}/events",
                          query=[("fieldSelector", f"involvedObject.kind={api.KIND},involvedObject.name={name}")])
    return sorted(found["items"], key=lambda e: e.get("eventTime") or e.get("firstTimestamp") or "")


def wait_events(kube: Kube, namespace: str, name: str, wanted: Callable[[dict[str, Any]], bool], what: str,
                timeout: float = 30) -> list[dict[str, Any]]:
    """The job's events that are `wanted`, once there is one. kopf posts events from a queue of its own,
    after the status write they come with: a test that has seen the status must still wait for them."""
    def found() -> list[dict[str, Any]]:
        return [e for e in events(kube, namespace, name) if wanted(e)]

    try:
        return wait_for(found, timeout, what)
    except AssertionError as error:
        posted = [f"{e['type']} {e['reason']}: {e['message'][:200]}" for e in events(kube, namespace, name)]
        raise AssertionError(f"{error}; events posted: {posted}") from None


def children(kube: Kube, namespace: str, job_name: str) -> dict[str, list[dict[str, Any]]]:
    """Every child of the job by kind, found by label (so duplicates would show)."""
    selector = f"rlhf.dev/job={job_name}"
    return {kind: kube.list(kind, namespace, selector)
            for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob")}


def wait_gone(kube: Kube, kind: str, namespace: str, name: str, timeout: float = 60) -> None:
    wait_for(lambda: kube.get(kind, namespace, name) is None, timeout, f"{kind} {name} to be deleted")


def touch_and_wait_reconciled(kube: Kube, namespace: str, name: str) -> None:
    """Change the job's metadata and wait until kopf has handled that change (its diffbase has it).

    A barrier: whatever the operator does on an update has been done when this returns.
    """
    touched = str(time.monotonic_ns())
    kube.patch(api.KIND, namespace, name, {"metadata": {"annotations": {"e2e.rlhf.dev/touch": touched}}})

    def handled() -> bool:
        annotations = get_job(kube, namespace, name)["metadata"].get("annotations") or {}
        return touched in annotations.get("rlhf.dev/last-handled-configuration", "")

    wait_for(handled, 30, f"the operator to handle an update of {name}")


def took(job: dict[str, Any]) -> float:
    """A finished job's time from status.startTime to status.completionTime, in seconds (whole ones: RFC 3339)."""
    start, end = (datetime.fromisoformat(job["status"][key]) for key in ("startTime", "completionTime"))
    return (end - start).total_seconds()


class StatusHistory:
    """Every status the RLHFJob is given, in the API server's order (a watch, so none is missed)."""

    def __init__(self, control_plane, namespace: str, name: str):
        from kubernetes import client

        self.api_client = control_plane.api_client()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.namespace, self.name = namespace, name
        self.seen: list[dict] = []
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for event in self.watch.stream(self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION,
                                           self.namespace, api.PLURAL, field_selector=f"metadata.name={self.name}"):
                status = event["object"].get("status") or {}
                if status.get("phase") and (not self.seen or self.seen[-1] != status):
                    self.seen.append(status)
        except ProtocolError:  # stop() closed the connection under the stream
            pass

    def stop(self) -> list[dict]:
        self.watch.stop()
        self.thread.join(10)
        self.api_client.close()
        return self.seen
