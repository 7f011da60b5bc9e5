"""The RLHFJob's lifecycle fields and what they mean for its RayJob: suspend, deadlines, TTL.

Pure functions. Suspend works through RayJob.spec.suspend, the same switch Kueue uses: KubeRay
deletes the Ray cluster of a suspended RayJob and starts a new one on resume (the trainer resumes
from the newest checkpoint). With spec.queueName, Kueue owns that switch while the user has not
suspended the job.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rlhf_api import v1alpha1 as api
from .status import finished

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# At most this long between the end of a run and the deletion of its Ray cluster: idle GPUs
# cost money, so a long ttlSecondsAfterFinished keeps the RLHFJob, not the cluster.
CLUSTER_TTL_MAX_SECONDS = 300


def ray_job_fields(spec: api.RLHFJobSpec) -> dict[str, Any]:
    """RayJob spec fields that follow the RLHFJob's mutable fields (None: field absent)."""
    return {
        "backoffLimit": spec.backoff_limit,
        "activeDeadlineSeconds": spec.active_deadline_seconds,
        "ttlSecondsAfterFinished": min(spec.ttl_seconds_after_finished or 0, CLUSTER_TTL_MAX_SECONDS),
    }


def initial_suspend(spec: api.RLHFJobSpec) -> bool:
    """A queued job starts suspended: Kueue admits it by clearing the flag."""
    return spec.suspend or bool(spec.queue_name)


def wanted_suspend(spec: api.RLHFJobSpec) -> bool | None:
    """The RayJob's suspend flag as the RLHFJob wants it; None leaves it to Kueue."""
    if spec.suspend:
        return True
    return None if spec.queue_name else False


def ray_job_patch(spec: api.RLHFJobSpec, ray_job: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch that brings an existing RayJob in line with the RLHFJob, or None."""
    current = ray_job.get("spec") or {}
    changed = {key: value for key, value in ray_job_fields(spec).items() if current.get(key) != value}
    suspend = wanted_suspend(spec)
    if suspend is not None and bool(current.get("suspend")) != suspend:
        changed["suspend"] = suspend
    patch: dict[str, Any] = {"spec": changed} if changed else {}
    if (ray_job["metadata"].get("labels") or {}).get(QUEUE_LABEL) != spec.queue_name:
        patch["metadata"] = {"labels": {QUEUE_LABEL: spec.queue_name}}
    return patch or None


def _parse(timestamp: str) -> datetime:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00"))


def seconds_until_expiry(spec: dict[str, Any], status: dict[str, Any] | None, now: datetime) -> float | None:
    """Seconds until a finished job's TTL runs out (<= 0: delete it now); None: it never expires."""
    ttl = spec.get("ttlSecondsAfterFinished")
    completed = (status or {}).get("completionTime")
    if ttl is None or not finished(status) or not completed:
        return None
    return ttl - (now - _parse(completed)).total_seconds()


def now() -> datetime:
    return datetime.now(timezone.utc)


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with seconds, as metav1.Time serialises."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
