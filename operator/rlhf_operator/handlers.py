"""kopf handler registrations, nothing else: `kopf run -m rlhf_operator.handlers` or `rlhf operator`.

- RLHFJob created, changed, or found at startup: reconcile (kopf retries failures with backoff);
  resync.py repeats it for unfinished jobs every --resync-seconds, so nothing stays stuck on a
  lost event.
- RayJob events (ours only, selected by label on the server): mirror status, recreate if deleted.
- Pod events of our Ray clusters that show a problem (unschedulable, image pull...): mirror status,
  so the reason reaches the job when the scheduler decides, not at the next resync.
- Finished RLHFJob with ttlSecondsAfterFinished: a daemon deletes it when the TTL runs out.
- Started RLHFJob with activeDeadlineSeconds: a daemon fails and stops it when the deadline passes
  (counted across KubeRay's retries, which restart KubeRay's own per-attempt deadline).
- Every event of a pod of our Ray clusters: its running time in the job's status.usage (usage.py).
- Every RLHFJob event: the jobs-by-phase metric (and the resync task started, once); the job reconciled
  if its RayJob differs from its spec (a change kopf forgot, see realign_ray_job); and the jobs
  Waiting for that job's model (models.<role>.fromJob) reconciled when its phase moved or it went.

Indexes kept by kopf from the watches it runs anyway stand in for reads (`Watched`): the RLHFJobs,
our RayJobs, and the pods of our Ray clusters that show a problem. A new job's RayJob is not in
its index, so it is created without a read first; a RayJob event finds its RLHFJob in its index (a
stale copy costs a read or a conflict: status writes are conditional, see reconcile.record).

The daemons make kopf put the finalizer rlhf.dev/finalizer on the RLHFJobs they run for (a
started job with a deadline, a finished one with a TTL: so it can stop them before the object
goes), and take it off when they end; deleting such a job while no operator runs waits for one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from . import inputs, lifecycle, metrics, names, pods, reconcile, resync, usage
from . import settings as operator_settings
from rlhf_api.v1alpha1 import GROUP, PLURAL, VERSION
from .names import JOB_LABEL

DEADLINE_RECHECK_SECONDS = 30


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    operator_settings.configure(settings)


@kopf.index(GROUP, VERSION, PLURAL)
async def rlhf_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): reconcile.watched_copy(body)}


@kopf.index("ray.io", "v1", "rayjobs")
async def ray_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): reconcile.watched_copy(body)}


@kopf.index("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT, pods.CLUSTER_LABEL: kopf.PRESENT},
            when=lambda body, **_: pods.pod_problem([body]) is not None)
async def stuck_pods(namespace: str, name: str, labels: kopf.Labels, status: kopf.Status,
                     **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, labels[pods.CLUSTER_LABEL]): {"metadata": {"name": name}, "status": dict(status)}}


class Watched(reconcile.Reads):
    """reconcile's reads answered from the indexes: None for what the watches have not seen.

    kopf keys an index's values by object uid and drops one only on its DELETED event, so an object
    deleted while a watch was down (kopf relists on 410 Gone) stays: a name can hold several values.
    Only one of them exists, created after the others went, so first seen last: the newest wins."""

    def __init__(self, kwargs: dict[str, Any]):
        self.jobs, self.ray_jobs, self.stuck_pods = kwargs["rlhf_jobs"], kwargs["ray_jobs"], kwargs["stuck_pods"]

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _newest(self.jobs.get((namespace, name), ()))

    def ray_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _newest(self.ray_jobs.get((namespace, name), ()))

    def pod_problem(self, namespace: str, cluster: str) -> tuple[str, str] | None:
        return pods.pod_problem(list(self.stuck_pods.get((namespace, cluster), ())))


def _newest(values: Any) -> dict[str, Any] | None:
    """Of the values an index keeps for a name, the one whose object it saw first last (a kopf Store
    iterates in the order its objects came)."""
    return next(reversed(list(values)), None)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_job(body: kopf.Body, **kwargs: Any) -> None:
    with metrics.measured("reconcile"):
        usage.settle(body)  # finished jobs too: at startup, the pods that went while no operator ran
        reconcile.reconcile(body, Watched(kwargs))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1,
             when=lambda spec, status, annotations, **_: lifecycle.seconds_until_expiry(
                 spec, status, lifecycle.now(), annotations) is not None)
async def delete_after_ttl(name: str, namespace: str, uid: str, spec: kopf.Spec, status: kopf.Status,
                           annotations: kopf.Annotations, **_: Any) -> None:
    left = lifecycle.seconds_until_expiry(spec, status, lifecycle.now(), annotations)
    await asyncio.sleep(max(0.0, left or 0.0))
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
def follow_ray_job(type: str | None, body: kopf.Body, **kwargs: Any) -> None:
    with metrics.measured("rayjob-event"):
        reconcile.on_ray_job_event(type, body, Watched(kwargs))


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT},
               when=lambda body, **_: pods.pod_problem([body]) is not None)
def follow_stuck_pod(body: kopf.Body, **kwargs: Any) -> None:
    with metrics.measured("pod-event"):
        reconcile.on_stuck_pod(body, Watched(kwargs))


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT, pods.CLUSTER_LABEL: kopf.PRESENT})
def count_pod_usage(type: str | None, body: kopf.Body, **kwargs: Any) -> None:
    with metrics.measured("pod-usage"):
        usage.on_pod_event(type, body, Watched(kwargs).job(body["metadata"]["namespace"], reconcile.job_of_pod(body)))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def count_job(type: str | None, uid: str, namespace: str, name: str, status: kopf.Status,
                    memo: kopf.Memo, **kwargs: Any) -> None:
    # async: a few dict operations, run on the event loop rather than sent to a handler thread on every event
    if type == "DELETED":
        metrics.JOBS.gone(uid)
    else:
        metrics.JOBS.seen(uid, namespace, name, status)
    resync.start(memo.resync_seconds, Watched(kwargs))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def realign_ray_job(type: str | None, namespace: str, name: str, uid: str, body: kopf.Body,
                          **kwargs: Any) -> None:
    # kopf retries a change's handler until it succeeds, but forgets the change if the spec returns to
    # what it last recorded as handled first: a suspension whose handler suspended the RayJob and then
    # failed (its status write), undone by a resume, left the RayJob suspended until a resync. So,
    # level-triggered: any event of a job whose RayJob differs from its spec reconciles it.
    ray_job = _newest(kwargs["ray_jobs"].get((namespace, names.ray_job(name)), ()))
    if type != "DELETED" and ray_job is not None and reconcile.drifted(body, ray_job):
        with metrics.measured("realign"):
            await asyncio.to_thread(reconcile.resync, namespace, name, uid, reconcile.API)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def start_dependents(type: str | None, namespace: str, name: str, uid: str, status: kopf.Status,
                           **kwargs: Any) -> None:
    # async: every job event (a trainer's progress too) scans the index on the event loop; only the jobs
    # to move are reconciled, in a thread.
    gone = type == "DELETED"
    for dependent in inputs.waiting_for(kwargs["rlhf_jobs"], namespace, name, None if gone else uid,
                                        None if gone else status.get("phase")):
        with metrics.measured("input-event"):
            # Read from the API server: the index may not have taken this very event in yet.
            await asyncio.to_thread(reconcile.resync, namespace, dependent["metadata"]["name"],
                                    dependent["metadata"]["uid"], reconcile.API)
