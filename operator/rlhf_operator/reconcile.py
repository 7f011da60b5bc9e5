"""Bring one RLHFJob's world in line with its spec; level-triggered and safe to kill at any line.

Every step reads what exists before it writes, children have deterministic names and are
created in order (the RayJob last), and status writes are conditional on the resourceVersion
they were computed from, so a run interrupted anywhere is finished by the next one: after a
restart the same state results, with one of each child.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import checks, kube, lifecycle, names, render, status
from rlhf_api import v1alpha1 as api
from rlhf_api.validation import InvalidJob, validate

log = logging.getLogger(__name__)

# Test seam: RLHF_OPERATOR_CRASH_AFTER=<step> ends the process right after that step as abruptly
# as a SIGKILL would. Steps: ConfigMap, ServiceAccount, Role, RoleBinding, RayJob (each after its
# child exists) and status (after a status write). e2e/operator/test_crash.py restarts the
# operator after each and checks that it converges with no duplicates.
CRASH_ENV = "RLHF_OPERATOR_CRASH_AFTER"
CRASH_EXIT_CODE = 137
STATUS_WRITE_ATTEMPTS = 5


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


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def ensure(child: dict[str, Any], owner_uid: str) -> dict[str, Any]:
    """The child as it exists, created if missing. A same-named object of someone else is not ours to use."""
    client = kube.client()
    meta = child["metadata"]
    existing = client.get(child["kind"], meta["namespace"], meta["name"])
    if existing is None:
        try:
            return client.create(child)
        except ApiException as error:
            if error.status != 409:
                raise
            existing = client.get(child["kind"], meta["namespace"], meta["name"])
            if existing is None:
                raise kopf.TemporaryError(f"{child['kind']} {meta['name']} is being deleted", delay=2) from None
    if _owned_by(existing, owner_uid):
        return existing
    if any(ref.get("kind") == api.KIND for ref in existing["metadata"].get("ownerReferences") or []):
        # A deleted RLHFJob of the same name left it; the garbage collector removes it shortly.
        raise kopf.TemporaryError(f"{child['kind']} {meta['name']} still belongs to a deleted RLHFJob "
                                  "of the same name; waiting for it to be garbage-collected", delay=2)
    raise checks.Unrealisable(
        "NameConflict", f"{child['kind']} {meta['name']} already exists and does not belong to this RLHFJob: "
        "delete it, or re-create the job under another name")


def record(body: Any, observation: status.Observation, generation: int | None) -> None:
    """Write the status fields the operator owns, then post an Event if the phase or reason moved.

    The write is a merge patch of our fields only (the trainer's progress and metrics stay), made
    conditional on the resourceVersion it was computed from; on a conflict it is recomputed.
    """
    client = kube.client()
    meta = body["metadata"]
    for _ in range(STATUS_WRITE_ATTEMPTS):
        current = dict(body.get("status") or {})
        desired = status.next_status(current, observation, lifecycle.timestamp(lifecycle.now()), generation)
        patch = status.changes(current, desired)
        if not patch:
            return
        try:
            body = client.patch(api.KIND, meta["namespace"], meta["name"], {
                "metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch,
            }, subresource="status")
        except ApiException as error:
            if error.status != 409:
                raise
            body = client.get(api.KIND, meta["namespace"], meta["name"])
            if body is None or body["metadata"]["uid"] != meta["uid"]:
                return  # deleted meanwhile
            meta = body["metadata"]
            continue
        crash_point("status")
        moved = status.transition(current, desired)
        if moved:
            kopf.event(body, type=moved.type, reason=moved.reason, message=moved.message)
        return
    raise kopf.TemporaryError("the RLHFJob kept changing while its status was written", delay=1)


def fail(body: Any, reason: str, message: str) -> None:
    log.warning("RLHFJob %s/%s cannot run: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
    record(body, status.Observation("Failed", reason, message), body["metadata"].get("generation"))


def mirror(body: Any, ray_job: dict[str, Any], generation: int | None) -> None:
    """Status from the RayJob. generation: the spec generation the RayJob was brought in line with."""
    spec = body["spec"]
    observation = status.observe(ray_job, suspend=spec.get("suspend", False), queue_name=spec.get("queueName"))
    record(body, observation, generation)


def reconcile(body: Any) -> None:
    """Check the job, create what is missing, align the RayJob's lifecycle fields, mirror status."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp") or status.finished(body.get("status")):
        return
    try:
        job = validate(_manifest(body))
    except InvalidJob as invalid:
        fail(body, "InvalidSpec", "; ".join(str(error) for error in invalid.errors))
        return
    client = kube.client()
    namespace = meta["namespace"]
    try:
        if client.get("RayJob", namespace, names.ray_job(meta["name"])) is None:
            checks.check(job, lambda name: kube.exists("ConfigMap", namespace, name))
        for child in render.supporting_children(job):
            ensure(child, meta["uid"])
            crash_point(child["kind"])
        ray_job = ensure(render.ray_job(job), meta["uid"])
        crash_point("RayJob")
    except checks.Unrealisable as bad:
        fail(body, bad.reason, bad.message)
        return
    patch = lifecycle.ray_job_patch(job.spec, ray_job)
    if patch:
        ray_job = client.patch("RayJob", namespace, ray_job["metadata"]["name"], patch)
    mirror(body, ray_job, meta.get("generation"))


def on_ray_job_event(event_type: str | None, ray_job: Any) -> None:
    """Follow a RayJob of ours: mirror its status into its RLHFJob, or recreate it if it was deleted."""
    ray_meta = ray_job["metadata"]
    owner = next((ref for ref in ray_meta.get("ownerReferences") or [] if ref.get("kind") == api.KIND), None)
    if owner is None:
        return
    body = kube.client().get(api.KIND, ray_meta["namespace"], owner["name"])
    if body is None or body["metadata"]["uid"] != owner["uid"] or body["metadata"].get("deletionTimestamp"):
        return  # the job is gone or going; the garbage collector takes care of the rest
    if event_type != "DELETED":
        mirror(body, dict(ray_job), None)
    elif status.finished(body.get("status")):
        kopf.event(body, type="Normal", reason="RayJobDeleted",
                   message=f"RayJob {ray_meta['name']} was deleted; the job has finished, so it is not recreated")
    else:
        # Recreate rather than fail: the desired state still says "run", and the trainer resumes
        # from the newest checkpoint. Deleting or suspending the RLHFJob is how a run is stopped.
        kopf.event(body, type="Warning", reason="RayJobDeleted",
                   message=f"RayJob {ray_meta['name']} was deleted out of band; recreating it "
                           "(the run resumes from the newest checkpoint)")
        reconcile(body)


def expire(namespace: str, name: str, uid: str) -> None:
    """TTL after finish: delete the RLHFJob (that very one), and with it its children."""
    body = kube.client().get(api.KIND, namespace, name)
    if body is None or body["metadata"]["uid"] != uid:
        return
    kopf.event(body, type="Normal", reason="TTLExpired",
               message="ttlSecondsAfterFinished has passed since the job finished; deleting it and its children")
    kube.client().delete(api.KIND, namespace, name, uid)
