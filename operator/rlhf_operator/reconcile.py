"""Bring one RLHFJob's world in line with its spec; level-triggered and safe to kill at any line.

Children have deterministic names and are created in order (the RayJob last), each created first
and read only when the API server answers that it exists (409), so its owner can be checked; status
writes are conditional on the resourceVersion they were computed from, so a run interrupted
anywhere is finished by the next one: after a restart the same state results, with one of each
child. What the operator's watches know (handlers.py's indexes) stands in for reads: a stale copy
costs a read (of the RayJob, where our own last write is newer) or a conflict and reads, never a
wrong write.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from rlhf_api import pipeline
from rlhf_api import v1alpha1 as api
from rlhf_api.validation import InvalidJob, validate

from . import checks, inputs, kube, kueue, lifecycle, names, pods, render, runtimes, status, usage

log = logging.getLogger(__name__)

# Test seam: RLHF_OPERATOR_CRASH_AFTER=<step> ends the process right after that step as abruptly
# as a SIGKILL would. Steps: ConfigMap, ServiceAccount, Role, RoleBinding, RayJob (each after its
# child exists) and status (after a status write). e2e/operator/test_operator_crash.py restarts the
# operator after each and checks that it converges with no duplicates.
CRASH_ENV = "RLHF_OPERATOR_CRASH_AFTER"
CRASH_EXIT_CODE = 137
STATUS_WRITE_ATTEMPTS = 5
DEPENDENCY_RETRY_SECONDS = 15  # how often a job waiting for a ConfigMap looks again
KUBERAY_RETRY_SECONDS = 30  # ... for the RayJob API to be served or to accept the RayJob
KEPT = 4096  # entries of each per-job memory below


class Kept:
    """A per-job memory shared by kopf's handler threads and the resync: bounded, the entry written
    least recently goes first (a running job's is rewritten on every status write and stays)."""

    def __init__(self, size: int = KEPT):
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            return self._items.get(key)

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._store(key, value)

    def pop(self, key: Any) -> None:
        with self._lock:
            self._items.pop(key, None)

    def setdefault(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value kept for key, made and kept first if there is none."""
        with self._lock:
            if key not in self._items:
                self._store(key, make())
            return self._items[key]

    def first(self, key: Any) -> bool:
        """Note key; True the first time (while it is kept)."""
        with self._lock:
            if key in self._items:
                return False
            self._store(key, True)
            return True

    def _store(self, key: Any, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self._size:
            self._items.popitem(last=False)


_warned_invalid = Kept()  # (uid, generation): SpecNoLongerValid posted once each
# (uid, generation) -> validate()'s verdict: a spec is checked once
_validated = Kept()
# uid -> the job as our newest status write returned it: a copy from the watch may predate that
# write, and is then caught up from it (record).
_written = Kept()
_writing = Kept()  # uid -> the lock that one status write of the job holds at a time (record)


class Reads:
    """Where the handlers learn what exists: here the API server; handlers.Watched answers the same
    questions from the operator's watches (kopf indexes) instead, None for what they have not seen."""

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.client().get(api.KIND, namespace, name)

    def ray_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.client().get("RayJob", namespace, name)

    def pod_problem(self, namespace: str, cluster: str) -> tuple[str, str] | None:
        """The first problem of the Ray cluster's pods (pods.pod_problem)."""
        return pods.pod_problem(kube.client().list("Pod", namespace, f"{pods.CLUSTER_LABEL}={cluster}"))


API = Reads()


def crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        log.warning("%s=%s: exiting abruptly", CRASH_ENV, step)
        logging.shutdown()
        os._exit(CRASH_EXIT_CODE)


def _manifest(body: Any) -> dict[str, Any]:
    """The RLHFJob as `validate` reads it: identity and spec only."""
    meta = body["metadata"]
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
        "spec": copy.deepcopy(dict(body["spec"])),
    }


def watched_copy(obj: Any) -> dict[str, Any]:
    """What an index keeps of a watched object: what the handlers read, without the bulk
    (managedFields, kopf's annotations, a RayJob's pod templates)."""
    meta = {key: value for key, value in obj["metadata"].items() if key not in ("managedFields", "annotations")}
    spec = {key: value for key, value in (obj.get("spec") or {}).items()
            if key not in ("rayClusterSpec", "submitterPodTemplate")}
    return {**obj, "metadata": meta, "spec": spec}


def _validated_job(body: Any) -> api.RLHFJob:
    """validate() of the job's spec (schema and CEL rules, about a millisecond), once per generation."""
    meta = body["metadata"]
    key = (meta["uid"], meta.get("generation"))
    verdict = _validated.get(key)
    if verdict is None:
        try:
            verdict = validate(_manifest(body))
        except InvalidJob as invalid:
            verdict = invalid
        _validated.put(key, verdict)
    if isinstance(verdict, InvalidJob):
        raise verdict
    return verdict


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def ensure(child: dict[str, Any], owner_uid: str) -> dict[str, Any]:
    """The child as it exists, created if missing. A same-named object of someone else is not ours to use.

    Created first: a new job's children do not exist yet, so a read first would be wasted on each."""
    client = kube.client()
    meta = child["metadata"]
    try:
        return client.create(child)
    except ApiException as error:
        if error.status != 409:
            raise
    existing = client.get(child["kind"], meta["namespace"], meta["name"])
    if existing is None:
        raise kopf.TemporaryError(f"{child['kind']} {meta['name']} is being deleted", delay=2)
    if _owned_by(existing, owner_uid):
        return existing
    if any(ref.get("kind") == api.KIND for ref in existing["metadata"].get("ownerReferences") or []):
        # A deleted RLHFJob of the same name left it; the garbage collector removes it shortly.
        raise kopf.TemporaryError(f"{child['kind']} {meta['name']} still belongs to a deleted RLHFJob "
                                  "of the same name; waiting for it to be garbage-collected", delay=2)
    raise checks.Unrealisable(
        "NameConflict", f"{child['kind']} {meta['name']} already exists and does not belong to this RLHFJob: "
        "delete it, or re-create the job under another name")


def record(body: Any, observation: status.Observation, generation: int | None,
           observe_again: Callable[[Any], status.Observation] | None = None, confirm: bool = False) -> None:
    """Write the status fields the operator owns, then post an Event if the phase or reason moved.

    The write is a merge patch of our fields only (the trainer's progress and metrics stay), made
    conditional on the resourceVersion it was computed from; on a conflict, or when the job as we last
    wrote it is newer than `body`, it is recomputed, from observe_again(that job) if given (what was
    observed may be as old as the job was). confirm: what was observed may be older than the status
    `body` carries (a watched copy, while `body` is fresh), so a change is observed again before it is
    written. One job's writes take turns: the handlers of its events, its pods' and the resync would
    otherwise write the same change at once, and all but one meet a conflict and read again.
    """
    with _writing.setdefault(body["metadata"]["uid"], threading.Lock):
        _record_in_turn(body, observation, generation, observe_again, confirm)


def _record_in_turn(body: Any, observation: status.Observation, generation: int | None,
                    observe_again: Callable[[Any], status.Observation] | None, confirm: bool) -> None:
    """record's write, made while it holds the job's turn."""
    client = kube.client()
    meta = body["metadata"]
    for _ in range(STATUS_WRITE_ATTEMPTS):
        ours = _written.get(meta["uid"])
        if ours is not None and status.owned(ours.get("status") or {}) != status.owned(body.get("status") or {}):
            # Read our own writes: this copy of the job predates our last write (a newer one, say with
            # kopf's annotations, would carry it), so the change is computed from the job as we wrote it
            # (if that is stale in turn, the conditional write below conflicts and the job is read afresh).
            # That write may have come from a newer RayJob than this observation did: observe again.
            body, meta = ours, ours["metadata"]
            if observe_again is not None:
                observation = observe_again(body)
        if observation.phase == "Succeeded":  # (observe_again's too)
            observation = replace(observation, output_model=_output_model(body))
        current = dict(body.get("status") or {})
        desired = status.next_status(current, observation, lifecycle.timestamp(lifecycle.now()), generation)
        patch = status.changes(current, desired)
        if not patch:
            return
        if confirm and observe_again is not None:
            confirm = False
            observation = observe_again(body)
            continue
        try:
            body = client.patch(api.KIND, meta["namespace"], meta["name"], {
                "metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch,
            }, subresource="status")
        except ApiException as error:
            if error.status == 404:
                return  # deleted: nothing to write to
            if error.status != 409:
                raise
            _written.pop(meta["uid"])  # someone wrote after us: the fresh read below is newer
            body = client.get(api.KIND, meta["namespace"], meta["name"])
            if body is None or body["metadata"]["uid"] != meta["uid"]:
                return  # deleted meanwhile
            meta = body["metadata"]
            if observe_again is not None:
                observation = observe_again(body)
            continue
        _written.put(meta["uid"], watched_copy(body))
        crash_point("status")
        moved = status.transition(current, desired, warning=observation.warning)
        if moved:
            kopf.event(body, type=moved.type, reason=moved.reason, message=moved.message)
        return
    raise kopf.TemporaryError("the RLHFJob kept changing while its status was written", delay=1)


def _output_model(body: Any) -> dict[str, Any] | None:
    """status.outputModel of a job that succeeded: where a later job's fromJob finds its model."""
    try:
        spec = _validated_job(body).spec
    except InvalidJob:
        return None
    current = body.get("status") or {}
    evaluation = (current.get("metrics") or {}).get("evaluation") or {}
    output = pipeline.output_model(body["metadata"]["name"], spec, (current.get("progress") or {}).get("step"),
                                   best="best/step" in evaluation)
    return output.model_dump(by_alias=True, exclude_none=True) if output else None


def fail(body: Any, reason: str, message: str) -> None:
    log.warning("RLHFJob %s/%s cannot run: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
    record(body, status.Observation("Failed", reason, message, warning=True), body["metadata"].get("generation"))


def wait(body: Any, reason: str, message: str, retry_seconds: float) -> None:
    """Pending with a reason a human can act on; kopf calls reconcile again after retry_seconds."""
    record(body, status.Observation("Pending", reason, message, warning=True), body["metadata"].get("generation"))
    raise kopf.TemporaryError(message, delay=retry_seconds)


def mirror(body: Any, ray_job: dict[str, Any], generation: int | None, reads: Reads = API,
           job_inputs: list[dict[str, Any]] | None = None, runtime: dict[str, Any] | None = None,
           watched: bool = False) -> None:
    """Status from the RayJob, and while it waits, from what it waits for: Kueue's admission (queued)
    or its pods (starting). generation: the spec generation the RayJob was brought in line with.
    On a conflict the RayJob is read again too: a newer status may have been written from a newer copy.
    Its pods' problems still come from `reads`: a pod watch is as fresh as a list of every pod.
    job_inputs: status.inputs as the RayJob was made from them (None: as they are); runtime: status.runtime
    likewise (runtimes.py). watched: ray_job is the watch's copy, which may lag the job's status (written from
    a newer RayJob event): a change it asks for is confirmed with a fresh read first."""
    namespace, name = ray_job["metadata"]["namespace"], ray_job["metadata"]["name"]

    def observe(job: Any, ray_job: dict[str, Any]) -> status.Observation:
        return replace(_observation(job, ray_job, reads), inputs=job_inputs, runtime=runtime)

    record(body, observe(body, ray_job), generation, lambda job: observe(job, API.ray_job(namespace, name) or ray_job),
           confirm=watched)


def _observation(body: Any, ray_job: dict[str, Any], reads: Reads) -> status.Observation:
    spec = body["spec"]
    # The queue the RayJob was made for: the job's, or its runtime's (runtimes.py)
    queue_name = ray_job["metadata"].get("labels", {}).get(lifecycle.QUEUE_LABEL)
    observation = status.observe(ray_job, suspend=spec.get("suspend", False), queue_name=queue_name)
    if observation.reason == "Queued":
        return observation.with_queue_reason(kueue.waiting_reason(kueue.workload(kube.client(), ray_job)))
    if observation.phase in ("Pending", "Provisioning"):
        problem = pods.cluster_problem(ray_job)
        cluster = (ray_job.get("status") or {}).get("rayClusterName")
        if problem is None and cluster:
            problem = reads.pod_problem(ray_job["metadata"]["namespace"], cluster)
        return observation.with_pod_problem(problem)
    return observation.with_kept_cluster(lifecycle.kept_cluster(ray_job))


def _age_seconds(meta: dict[str, Any]) -> float:
    created = meta.get("creationTimestamp")
    return (lifecycle.now() - lifecycle.parse(created)).total_seconds() if created else 0.0


def _create_ray_job(body: Any, job: api.RLHFJob) -> dict[str, Any]:
    """The RayJob, created if missing. An API server that does not serve RayJobs (KubeRay is not
    installed) or refuses this one leaves the job Pending with the reason, retried, never lost."""
    try:
        return ensure(render.ray_job(job), body["metadata"]["uid"])
    except ApiException as error:
        if error.status == 404:
            wait(body, "KubeRayNotInstalled", "this cluster does not serve RayJobs (ray.io/v1): install KubeRay's "
                 "CRDs and operator; the job starts once they are there", KUBERAY_RETRY_SECONDS)
        if error.status in (400, 403, 422):
            wait(body, "RayJobNotCreated", f"the API server refused the RayJob ({error.status} {error.reason}): "
                 f"{_api_message(error)}", KUBERAY_RETRY_SECONDS)
        raise


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body or "{}").get("message") or str(error.reason)
    except ValueError:
        return str(error.reason)


def _reported_end(body: Any) -> tuple[str, str] | None:
    """The trainer's own report that the run ended ((phase, message), from status.progress.result).

    A Failed report ends the job only when KubeRay had no retry to give (backoffLimit 0): the result
    stays until the next attempt's trainer clears it, so in KubeRay's retry gap it is the failed
    attempt's, and a RayJob deleted then is recreated (the run resumes from the newest checkpoint)."""
    progress = (body.get("status") or {}).get("progress") or {}
    result = progress.get("result")
    if result not in status.TERMINAL or (result == "Failed" and body["spec"].get("backoffLimit")):
        return None
    return result, f"The trainer reported the run {result.lower()} at step {progress.get('summary', '?')}; its RayJob is gone"


def resync(namespace: str, name: str, uid: str, reads: Reads) -> bool:
    """Reconcile the job as the API server has it now; False if it is gone. The watch's copy may be
    a ghost: kopf's indexes drop an object only on its DELETED event, and a relist after a watch
    expired (410 Gone) does not remove the jobs deleted meanwhile."""
    body = API.job(namespace, name)
    if body is None or body["metadata"]["uid"] != uid:
        return False
    # This read is as new as our last status write or newer: compared with it, not with that write,
    # a status another hand wrote since (one we would write again) is put right here at the latest.
    _written.pop(uid)
    usage.settle(body)
    reconcile(body, reads)
    return True


def drifted(body: Any, ray_job: dict[str, Any]) -> bool:
    """Whether the RayJob's lifecycle fields (suspend, deadlines, ...) differ from what the job's spec asks;
    a finished, going or invalid job asks nothing."""
    if body["metadata"].get("deletionTimestamp") or status.finished(body.get("status")):
        return False
    try:
        return lifecycle.ray_job_patch(_validated_job(body).spec, ray_job) is not None
    except InvalidJob:
        return False


def _is_live(job: dict[str, Any] | None, uid: str) -> bool:
    """That very job (not a newer one of the same name), and not being deleted."""
    return job is not None and job["metadata"]["uid"] == uid and not job["metadata"].get("deletionTimestamp")


def reconcile(body: Any, reads: Reads = API) -> None:
    """Check the job, create what is missing, align the RayJob's lifecycle fields, mirror status."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp") or status.finished(body.get("status")):
        return
    client = kube.client()
    namespace = meta["namespace"]
    ray_job = reads.ray_job(namespace, names.ray_job(meta["name"]))
    watched = ray_job if reads is not API else None  # the watch's copy: mirror confirms a change it asks for
    if ray_job is not None and meta.get("generation") != (body.get("status") or {}).get("observedGeneration"):
        # A spec change not yet carried over: compared with the RayJob as it is. A watched copy may
        # predate this operator's own last patch of it and already read what the change asks for.
        ray_job = API.ray_job(namespace, names.ray_job(meta["name"]))
    if ray_job is not None and not _owned_by(ray_job, meta["uid"]):
        ray_job = None  # someone else's, or a deleted same-named job's: ensure() below says which
    try:
        job = _validated_job(body)
    except InvalidJob as invalid:
        problems = "; ".join(str(error) for error in invalid.errors)
        if ray_job is None:
            fail(body, "InvalidSpec", problems)
            return
        # Admitted by an earlier schema and running: a stricter operator must not leave a running
        # RayJob behind a Failed status. Follow it, and say what a new job would have to change.
        if _warned_invalid.first((meta["uid"], meta.get("generation"))):
            kopf.warn(body, reason="SpecNoLongerValid", message=f"this operator version would refuse the spec "
                      f"({problems}); the running job continues: fix the spec before you create the next one")
        mirror(body, ray_job, None, reads, watched=ray_job is watched)
        return
    if ray_job is None and (ended := _reported_end(body)) is not None:
        record(body, status.Observation(ended[0], "RayJobGone", ended[1]), meta.get("generation"))
        return
    left = lifecycle.seconds_until_deadline(body["spec"], body.get("status"), lifecycle.now())
    if left is not None and left <= 0:  # before any child is created or patched: the job ends here
        stop_at_deadline(body, ray_job)
        return
    job_inputs = runtime = None
    try:
        recorded = (body.get("status") or {}).get("runtime")
        if recorded or ray_job is None:  # a job made before its namespace had a default runtime keeps none
            job, runtime = runtimes.resolve(job, recorded, client, _age_seconds(meta))
        # Children are created before the RayJob, so while it exists they were made (one deleted out
        # of band since is made again with the RayJob, not on every reconcile).
        if ray_job is None:
            if body.get("status") and not _is_live(API.job(namespace, meta["name"]), meta["uid"]):
                return  # a lagging copy of a job deleted since: nothing is made for it (the index keeps
                # such ghosts, see resync; the garbage collector would delete what was made, after the fact)
            resolved = inputs.resolve(job, (body.get("status") or {}).get("inputs") or [], reads, _age_seconds(meta))
            if isinstance(resolved, status.Observation):  # waiting for its input jobs, or failed by one
                record(body, resolved, meta.get("generation"))
                return
            job, job_inputs = resolved
            checks.check(job, lambda name: kube.exists("ConfigMap", namespace, name),
                         lambda name: client.get("PersistentVolumeClaim", namespace, name), waited=_age_seconds(meta))
            for child in render.supporting_children(job):
                ensure(child, meta["uid"])
                crash_point(child["kind"])
            ray_job = _create_ray_job(body, job)
            crash_point("RayJob")
    except checks.Waiting as waiting:
        wait(body, waiting.reason, waiting.message, DEPENDENCY_RETRY_SECONDS)
    except checks.Unrealisable as bad:
        fail(body, bad.reason, bad.message)
        return
    patch = lifecycle.ray_job_patch(job.spec, ray_job)
    if patch:
        ray_job = client.patch("RayJob", namespace, ray_job["metadata"]["name"], patch)
    if job.spec.queue_name:
        _align_workload(client, job.spec, ray_job)
    mirror(body, ray_job, meta.get("generation"), reads, job_inputs, runtime, watched=ray_job is watched)


def _align_workload(client: kube.Kube, spec: api.RLHFJobSpec, ray_job: dict[str, Any]) -> None:
    """A queued job is suspended and resumed through its Workload (kueue.py)."""
    workload = kueue.workload(client, ray_job)
    if workload is None:
        if spec.suspend:  # Kueue has not made it yet: be back before it can admit the job
            raise kopf.TemporaryError("waiting for Kueue to create the Workload of a suspended job", delay=2)
        return
    patch = kueue.active_patch(workload, spec.suspend)
    if patch:
        kueue.patch(client, workload, patch)


def stop_at_deadline(body: Any, ray_job: dict[str, Any] | None) -> None:
    """activeDeadlineSeconds passed: Failed first (final, so the RayJob is not recreated), then stop it."""
    deadline = body["spec"]["activeDeadlineSeconds"]
    fail(body, "DeadlineExceeded", f"The job ran longer than spec.activeDeadlineSeconds ({deadline}s, counted from "
         f"its start {body['status']['startTime']} across every attempt): stopped. Raise it and re-create the job "
         "to continue from the newest checkpoint")
    if ray_job is not None:
        kube.client().delete("RayJob", ray_job["metadata"]["namespace"], ray_job["metadata"]["name"],
                             ray_job["metadata"]["uid"])


def deadline_passed(namespace: str, name: str, uid: str) -> None:
    """The deadline daemon's wake-up: stop that very job if its deadline has really passed."""
    body = kube.client().get(api.KIND, namespace, name)
    if body is None or body["metadata"]["uid"] != uid:
        return
    left = lifecycle.seconds_until_deadline(body["spec"], body.get("status"), lifecycle.now())
    if left is not None and left <= 0:
        stop_at_deadline(body, kube.client().get("RayJob", namespace, names.ray_job(name)))


def job_of_pod(pod: Any) -> str:
    """The name of the RLHFJob a pod of our Ray clusters belongs to."""
    meta = pod["metadata"]
    return (meta.get("annotations") or {}).get(names.JOB_ANNOTATION) or meta["labels"][names.JOB_LABEL]


def on_stuck_pod(pod: Any, reads: Reads = API) -> None:
    """A pod of one of our Ray clusters cannot start: mirror now, with its reason, if the job waits on it."""
    namespace = pod["metadata"]["namespace"]
    body = reads.job(namespace, job_of_pod(pod))
    if body is None or body["metadata"].get("deletionTimestamp") or status.finished(body.get("status")):
        return
    ray_job = reads.ray_job(namespace, names.ray_job(body["metadata"]["name"]))
    if ray_job is not None:
        mirror(body, ray_job, None, reads, watched=reads is not API)


def on_ray_job_event(event_type: str | None, ray_job: Any, reads: Reads = API) -> None:
    """Follow a RayJob of ours: mirror its status into its RLHFJob, or recreate it if it was deleted."""
    ray_meta = ray_job["metadata"]
    owner = next((ref for ref in ray_meta.get("ownerReferences") or [] if ref.get("kind") == api.KIND), None)
    if owner is None:
        return
    if event_type == "DELETED":  # what follows may recreate the RayJob: read the job fresh
        reads = API
    body = reads.job(ray_meta["namespace"], owner["name"])
    if not _is_live(body, owner["uid"]):
        return  # the job is gone or going; the garbage collector takes care of the rest
    if event_type != "DELETED":
        mirror(body, dict(ray_job), None, reads)
        return
    if status.ray_job_finished(ray_job) and not status.finished(body.get("status")):
        # Deleted after it finished (KubeRay's deletion policy, or by hand) before its end was mirrored:
        # its last state says how the run ended.
        mirror(body, dict(ray_job), None)
        body = kube.client().get(api.KIND, ray_meta["namespace"], owner["name"]) or body
    if status.finished(body.get("status")):
        kopf.event(body, type="Normal", reason="RayJobDeleted",
                   message=f"RayJob {ray_meta['name']} was deleted; the job has finished, so it is not recreated")
    else:
        # Recreate rather than fail: the desired state still says "run", and the trainer resumes
        # from the newest checkpoint. Deleting or suspending the RLHFJob is how a run is stopped.
        kopf.event(body, type="Warning", reason="RayJobDeleted",
                   message=f"RayJob {ray_meta['name']} was deleted out of band; recreating it "
                           "(the run resumes from the newest checkpoint)")
        reconcile(body, reads)


def expire(namespace: str, name: str, uid: str) -> None:
    """TTL after finish: delete the RLHFJob (that very one), and with it its children."""
    body = kube.client().get(api.KIND, namespace, name)
    if body is None or body["metadata"]["uid"] != uid:
        return
    kopf.event(body, type="Normal", reason="TTLExpired",
               message="ttlSecondsAfterFinished has passed since the job finished; deleting it and its children")
    kube.client().delete(api.KIND, namespace, name, uid)
