"""The RLHFJob's lifecycle fields and what they mean for its RayJob: suspend, deadlines, TTL.

Pure functions. Suspend works through RayJob.spec.suspend: KubeRay deletes the Ray cluster of a
suspended RayJob and starts a new one on resume (the trainer resumes from the newest checkpoint).
With spec.queueName, Kueue owns that switch and the operator never writes it: suspending a queued
job deactivates its Workload instead (kueue.py). The queue label is set once, at creation
(spec.queueName is immutable: Kueue refuses to relabel an admitted job).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from rlhf_api import v1alpha1 as api
from .status import finished

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# At most this long between the end of a run and the deletion of its Ray cluster: idle GPUs
# cost money, so a long ttlSecondsAfterFinished keeps the RLHFJob, not the cluster.
CLUSTER_TTL_MAX_SECONDS = 300


# KubeRay writes the RayJob back without its false booleans (Go's omitempty): absent reads as this.
KUBERAY_OMITTED = {"shutdownAfterJobFinishes": False}


def ray_job_fields(spec: api.RLHFJobSpec) -> dict[str, Any]:
    """RayJob spec fields that follow the RLHFJob's mutable fields (None: field absent)."""
    cluster_ttl = min(spec.ttl_seconds_after_finished or 0, CLUSTER_TTL_MAX_SECONDS)
    # KubeRay's deletionRules (feature gate RayJobDeletionPolicy, on by default since v1.6) exclude
    # shutdownAfterJobFinishes and its TTL, and KubeRay refuses to suspend a RayJob without
    # shutdownAfterJobFinishes: a suspended job goes back to it (one patch with the suspend flag).
    keep = spec.keep_failed_cluster is not None and not spec.suspend
    return {
        "backoffLimit": spec.backoff_limit,
        # Per attempt in KubeRay; the operator enforces the total across attempts (seconds_until_deadline).
        "activeDeadlineSeconds": spec.active_deadline_seconds,
        "preRunningDeadlineSeconds": spec.startup_deadline_seconds,
        "shutdownAfterJobFinishes": not keep,
        "ttlSecondsAfterFinished": 0 if keep else cluster_ttl,
        "deletionStrategy": _keep_failed_cluster(spec.keep_failed_cluster, cluster_ttl) if keep else None,
    }


def _keep_failed_cluster(keep: api.KeepFailedCluster, cluster_ttl: int) -> dict[str, Any]:
    """A succeeded run's cluster goes as with shutdownAfterJobFinishes; a failed one's after keep.seconds,
    or never (no rule: the RLHFJob's deletion takes it). KubeRay records every failure as
    jobDeploymentStatus Failed (a failed Ray job, a failed submission, a deadline)."""
    rules = [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": cluster_ttl}}]
    if keep.seconds is not None:
        rules.append({"policy": "DeleteCluster", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": keep.seconds}})
    return {"deletionRules": rules}


def kept_cluster(ray_job: dict[str, Any]) -> dict[str, Any] | None:
    """The Ray cluster a finished RayJob's deletion rules keep ({name, until}; no until: until the RayJob
    goes), read as KubeRay reads them: the rules whose condition matches its status, the earliest first."""
    rules = ((ray_job.get("spec") or {}).get("deletionStrategy") or {}).get("deletionRules")
    status = ray_job.get("status") or {}
    if not rules or not status.get("rayClusterName"):
        return None
    matched = [rule["condition"].get("ttlSeconds", 0) for rule in rules
               if rule["policy"] in ("DeleteCluster", "DeleteSelf") and _matches(rule["condition"], status)]
    kept: dict[str, Any] = {"name": status["rayClusterName"]}
    if matched:
        ended = parse(status["endTime"]) if status.get("endTime") else now()
        kept["until"] = timestamp(ended + timedelta(seconds=min(matched)))
    return kept


def _matches(condition: dict[str, Any], status: dict[str, Any]) -> bool:
    if "jobStatus" in condition:
        return condition["jobStatus"] == status.get("jobStatus")
    return condition.get("jobDeploymentStatus") == status.get("jobDeploymentStatus")


def initial_suspend(spec: api.RLHFJobSpec) -> bool:
    """A queued job starts suspended: Kueue admits it by clearing the flag."""
    return spec.suspend or bool(spec.queue_name)


def wanted_suspend(spec: api.RLHFJobSpec) -> bool | None:
    """The RayJob's suspend flag as the RLHFJob wants it; None leaves it to Kueue."""
    return None if spec.queue_name else spec.suspend


def ray_job_patch(spec: api.RLHFJobSpec, ray_job: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch that brings an existing RayJob in line with the RLHFJob, or None."""
    current = ray_job.get("spec") or {}
    changed = {key: value for key, value in ray_job_fields(spec).items()
               if current.get(key, KUBERAY_OMITTED.get(key)) != value}
    suspend = wanted_suspend(spec)
    if suspend is not None and bool(current.get("suspend")) != suspend:
        changed["suspend"] = suspend
    return {"spec": changed} if changed else None


def parse(timestamp: str) -> datetime:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00"))


# Argo CD marks what it syncs with this annotation (its default tracking method since 3.0). Deleting
# such a job would be undone by auto-sync, which would create it again and rerun it.
ARGOCD_TRACKING = "argocd.argoproj.io/tracking-id"


def seconds_until_expiry(spec: dict[str, Any], status: dict[str, Any] | None, now: datetime,
                         annotations: dict[str, str] | None = None) -> float | None:
    """Seconds until a finished job's TTL runs out (<= 0: delete it now); None: it never expires
    (no TTL, not finished yet, or synced by Argo CD: Git decides when it goes)."""
    ttl = spec.get("ttlSecondsAfterFinished")
    completed = (status or {}).get("completionTime")
    if ttl is None or not finished(status) or not completed or ARGOCD_TRACKING in (annotations or {}):
        return None
    return ttl - (now - parse(completed)).total_seconds()


def seconds_until_deadline(spec: dict[str, Any], status: dict[str, Any] | None, now: datetime) -> float | None:
    """Seconds left of activeDeadlineSeconds (<= 0: exceeded), counted from status.startTime: the start of
    the first attempt since the job was created or last resumed, so KubeRay's retries share one deadline
    (KubeRay's own restarts with each). None: no deadline, or not running."""
    deadline = spec.get("activeDeadlineSeconds")
    started = (status or {}).get("startTime")
    if deadline is None or not started or finished(status):
        return None
    return deadline - (now - parse(started)).total_seconds()


def now() -> datetime:
    return datetime.now(timezone.utc)


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with seconds, as metav1.Time serialises."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
