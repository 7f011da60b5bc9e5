"""Kueue: a queued job's Workload is where admission is decided and where a job is stopped.

Kueue owns the RayJob's suspend flag while a job has a queue (it clears it on admission and sets it
on eviction), so the operator never writes that flag for a queued job: spec.suspend deactivates
the job's Workload (spec.active false), Kueue's own stop switch, which evicts it and suspends the
RayJob once; resuming reactivates it and Kueue admits it again by quota.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from .kube import Kube

JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on the Workload: the uid of the job it admits


def workload(client: Kube, ray_job: dict[str, Any]) -> dict[str, Any] | None:
    """The RayJob's Workload; None before Kueue made it, or on a cluster without Kueue."""
    meta = ray_job["metadata"]
    try:
        found = client.list("Workload", meta["namespace"], f"{JOB_UID_LABEL}={meta['uid']}")
    except ApiException as error:
        if error.status == 404:  # Kueue's CRDs are not installed
            return None
        raise
    return found[0] if found else None


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
