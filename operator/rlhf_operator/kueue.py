"""Kueue: a queued job's Workload is where admission is decided and where a job is stopped.

Kueue owns the RayJob's suspend flag while a job has a queue (it clears it on admission and sets it
on eviction), so the operator never writes that flag for a queued job: spec.suspend deactivates
the job's Workload (spec.active false), Kueue's own stop switch, which evicts it and suspends the
RayJob once; resuming reactivates it and Kueue admits it again by quota.

The Workload is read and written at the newest version the API server serves (VERSIONS): Kueue 0.15 and
later serve v1beta2, older ones only v1beta1, whose fields used here (spec.active, the QuotaReserved
condition) are the same. The version is discovered once per client; a cluster without Kueue is asked again
each time, so a Kueue installed after the operator started is found.
"""

from __future__ import annotations

import weakref
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from .kube import MERGE_PATCH, Kube

GROUP = "kueue.x-k8s.io"
VERSIONS = ("v1beta2", "v1beta1")  # newest first
PLURAL = "workloads"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on the Workload: the uid of the job it admits

_served: weakref.WeakKeyDictionary[Kube, str] = weakref.WeakKeyDictionary()


def served_version(client: Kube) -> str | None:
    """The newest of VERSIONS the API server serves Kueue's API at (API discovery); None without Kueue."""
    if client not in _served:
        groups = k8s.ApisApi(client.api_client).get_api_versions(_request_timeout=client.timeout).groups
        served = {version.version for group in groups if group.name == GROUP for version in group.versions}
        found = next((version for version in VERSIONS if version in served), None)
        if found is None:
            return None
        _served[client] = found
    return _served[client]


def workload(client: Kube, ray_job: dict[str, Any]) -> dict[str, Any] | None:
    """The RayJob's Workload; None before Kueue made it, or on a cluster without Kueue."""
    version = served_version(client)
    if version is None:
        return None
    meta = ray_job["metadata"]
    try:
        found = _objects(client).list_namespaced_custom_object(
            GROUP, version, meta["namespace"], PLURAL, label_selector=f"{JOB_UID_LABEL}={meta['uid']}",
            _request_timeout=client.timeout)["items"]
    except ApiException as error:
        if error.status == 404:  # that version went (Kueue removed or upgraded): discovered again next time
            _served.pop(client, None)
            return None
        raise
    return found[0] if found else None


def patch(client: Kube, workload_obj: dict[str, Any], merge_patch: dict[str, Any]) -> None:
    """A merge patch of the Workload, at the version it was read."""
    meta = workload_obj["metadata"]
    _objects(client).patch_namespaced_custom_object(
        GROUP, workload_obj["apiVersion"].split("/")[1], meta["namespace"], PLURAL, meta["name"], merge_patch,
        _content_type=MERGE_PATCH, _request_timeout=client.timeout)


def _objects(client: Kube) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(client.api_client)


def active(workload_obj: dict[str, Any]) -> bool:
    return (workload_obj.get("spec") or {}).get("active", True) is not False


def active_patch(workload_obj: dict[str, Any], suspend: bool) -> dict[str, Any] | None:
    """The merge patch that makes the Workload's activity follow spec.suspend, or None."""
    return None if active(workload_obj) != suspend else {"spec": {"active": not suspend}}


def waiting_reason(workload_obj: dict[str, Any] | None) -> tuple[str, str] | None:
    """Why Kueue has not admitted the job yet, in Kueue's words (QuotaReserved false: its reason and message)."""
    for condition in ((workload_obj or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "QuotaReserved" and condition.get("status") == "False":
            return condition.get("reason") or "Pending", condition.get("message") or ""
    return None
