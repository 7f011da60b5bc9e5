"""A job's runtime (spec.runtimeRef, or the default one), read once when the job starts and recorded in
status.runtime with the spec it had: every later reconcile applies that record, so editing or deleting the
runtime changes no job made from it (Kubeflow Trainer's runtimes behave the same).

A runtime named but missing makes the job wait (reason RuntimeNotFound: `kubectl apply -f dir/` may create
the job before its runtime) and fail after checks.DEPENDENCY_WAIT_SECONDS; a field the job sets that the runtime
locks fails it at once (RuntimeFieldLocked). The API server cannot refuse either at admission: CEL sees only the
object itself, and a ValidatingAdmissionPolicy's params are ANDed over every runtime a binding selects, so it
cannot ask whether one of a given name exists.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from rlhf_api import v1alpha1 as api
from rlhf_api.runtimes import applied, locked_fields_set
from rlhf_api.v1alpha1.runtime import CLUSTER_RUNTIME_KIND, RUNTIME_KIND, RLHFRuntime

from . import kube
from .checks import DEPENDENCY_WAIT_SECONDS, Unrealisable, Waiting


def resolve(job: api.RLHFJob, recorded: dict[str, Any] | None, client: kube.Kube,
            waited: float) -> tuple[api.RLHFJob, dict[str, Any] | None]:
    """The job with its runtime applied, and status.runtime to record (None: no runtime). recorded: status.runtime
    as written when the job started."""
    if recorded is not None:
        return _applied(job, api.RuntimeStatus.model_validate(recorded)), recorded
    found = _named(job, client, waited) if job.spec.runtime_ref else _default(job.metadata["namespace"], client)
    if found is None:
        return job, None
    try:
        runtime = RLHFRuntime.model_validate(found)
    except ValidationError as invalid:
        raise Unrealisable("RuntimeInvalid", f"{found['kind']} {found['metadata']['name']} does not validate "
                           f"({invalid.error_count()} errors, first: {invalid.errors()[0]['msg']}): fix it, then "
                           "re-create this job") from None
    record = api.RuntimeStatus(kind=found["kind"], name=found["metadata"]["name"],
                               generation=found["metadata"].get("generation"), spec=runtime.spec)
    return _applied(job, record), record.model_dump(mode="json", by_alias=True, exclude_none=True)


def _applied(job: api.RLHFJob, record: api.RuntimeStatus) -> api.RLHFJob:
    locked = locked_fields_set(job.spec, record.spec)
    if locked:
        raise Unrealisable("RuntimeFieldLocked", f"{record.kind} {record.name} sets {', '.join(locked)} for every "
                           "job made with it and locks them: remove them from this job (or ask the runtime's owner), "
                           "then re-create it")
    return job.model_copy(update={"spec": applied(job.spec, record.spec)})


def _named(job: api.RLHFJob, client: kube.Kube, waited: float) -> dict[str, Any]:
    ref, namespace = job.spec.runtime_ref, job.metadata["namespace"]
    found = client.get(ref.kind, namespace if ref.kind == RUNTIME_KIND else "", ref.name)
    if found is not None:
        return found
    where = f" in namespace {namespace}" if ref.kind == RUNTIME_KIND else ""
    missing = f"spec.runtimeRef names {ref.kind} {ref.name}, which does not exist{where}"
    if waited < DEPENDENCY_WAIT_SECONDS:
        raise Waiting("RuntimeNotFound", f"{missing} yet: waiting up to {DEPENDENCY_WAIT_SECONDS}s after creation "
                      "for it to appear (`kubectl get clusterrlhfruntimes,rlhfruntimes -A` lists them)")
    raise Unrealisable("RuntimeNotFound", f"{missing} after {DEPENDENCY_WAIT_SECONDS}s: create it or fix the name, "
                       "then re-create this job")


def _default(namespace: str, client: kube.Kube) -> dict[str, Any] | None:
    """The namespace's default RLHFRuntime, else the default ClusterRLHFRuntime; the oldest when several are."""
    for kind, where in ((RUNTIME_KIND, namespace), (CLUSTER_RUNTIME_KIND, "")):
        try:
            listed = client.list(kind, where, "")
        except ApiException as error:
            if error.status == 404:  # the runtime CRDs are not installed: no runtimes
                continue
            raise
        marked = [r for r in listed if (r.get("spec") or {}).get("default")]
        if marked:  # a list's items carry no kind
            return {**min(marked, key=lambda r: (r["metadata"]["creationTimestamp"], r["metadata"]["name"])),
                    "kind": kind}
    return None
