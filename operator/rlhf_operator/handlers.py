"""kopf handler registrations, nothing else: `kopf run -m rlhf_operator.handlers` or `rlhf operator`.

- RLHFJob created, changed, or found at startup: reconcile (kopf retries failures with backoff);
  a resync timer repeats it for unfinished jobs, so nothing stays stuck on a lost event.
- RayJob events (ours only, selected by label on the server): mirror status, recreate if deleted.
- Pod events of our Ray clusters that show a problem (unschedulable, image pull...): mirror status,
  so the reason reaches the job when the scheduler decides, not at the next resync.
- Finished RLHFJob with ttlSecondsAfterFinished: a daemon deletes it when the TTL runs out.
- Started RLHFJob with activeDeadlineSeconds: a daemon fails and stops it when the deadline passes
  (counted across KubeRay's retries, which restart KubeRay's own per-attempt deadline).
- Every RLHFJob event: the jobs-by-phase metric.

The timer and the daemon make kopf put the finalizer rlhf.dev/finalizer on RLHFJobs (so it can
stop them before the object goes): deleting a job while no operator runs waits for one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from . import lifecycle, metrics, pods, reconcile
from . import settings as operator_settings
from rlhf_api.v1alpha1 import GROUP, PLURAL, VERSION
from .names import JOB_LABEL
from .status import finished

RESYNC_SECONDS = 120
DEFAULT_METRICS_PORT = 8080
DEADLINE_RECHECK_SECONDS = 30


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    operator_settings.configure(settings)
    metrics.serve(memo.get("metrics_port", DEFAULT_METRICS_PORT))


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_job(body: kopf.Body, **_: Any) -> None:
    with metrics.measured("reconcile"):
        reconcile.reconcile(body)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS,
            when=lambda status, **_: not finished(status))
def resync_job(body: kopf.Body, **_: Any) -> None:
    with metrics.measured("resync"):
        reconcile.reconcile(body)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1,
             when=lambda spec, status, **_: lifecycle.seconds_until_expiry(spec, status, lifecycle.now()) is not None)
async def delete_after_ttl(name: str, namespace: str, uid: str, spec: kopf.Spec, status: kopf.Status,
                           **_: Any) -> None:
    await asyncio.sleep(max(0.0, lifecycle.seconds_until_expiry(spec, status, lifecycle.now()) or 0.0))
    with metrics.measured("ttl"):
        await asyncio.to_thread(reconcile.expire, namespace, name, uid)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1,
             when=lambda spec, status, **_: lifecycle.seconds_until_deadline(spec, status, lifecycle.now()) is not None)
async def enforce_deadline(name: str, namespace: str, uid: str, spec: kopf.Spec, status: kopf.Status,
                           **_: Any) -> None:
    # spec and status are live: a resume (new startTime) or a raised deadline moves the wake-up.
    while (left := lifecycle.seconds_until_deadline(spec, status, lifecycle.now())) is not None:
        if left <= 0:
            with metrics.measured("deadline"):
                await asyncio.to_thread(reconcile.deadline_passed, namespace, name, uid)
            return
        await asyncio.sleep(min(left, DEADLINE_RECHECK_SECONDS))


@kopf.on.event("ray.io", "v1", "rayjobs")
def follow_ray_job(type: str | None, body: kopf.Body, **_: Any) -> None:
    with metrics.measured("rayjob-event"):
        reconcile.on_ray_job_event(type, body)


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT},
               when=lambda body, **_: pods.pod_problem([body]) is not None)
def follow_stuck_pod(body: kopf.Body, **_: Any) -> None:
    with metrics.measured("pod-event"):
        reconcile.on_stuck_pod(body)


@kopf.on.event(GROUP, VERSION, PLURAL)
def count_job(type: str | None, uid: str, status: kopf.Status, **_: Any) -> None:
    if type == "DELETED":
        metrics.JOBS.gone(uid)
    else:
        metrics.JOBS.seen(uid, status.get("phase"))
