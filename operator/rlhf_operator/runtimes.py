"""A job's runtime (spec.runtimeRef, or the default one), read once when the job starts and recorded in
status.runtime with the spec it had: every later reconcile applies that record, so editing or deleting the
runtime changes no job made from it (Kubeflow Trainer's runtimes behave the same).

Where the chart installs the admission webhook (admission.py), a new job whose runtime is missing or that sets
what its runtime locks is refused by this very resolution, before it is stored. Without it (a cluster installed
without the webhook, or a job admitted while none answered) the operator refuses the same: a runtime named but
missing makes the job wait (reason RuntimeNotFound: `kubectl apply -f dir/` may create the job before its runtime)
and fail after checks.DEPENDENCY_WAIT_SECONDS; a field the job sets that the runtime locks fails it at once
(RuntimeFieldLocked). CEL cannot refuse either: it sees only the object itself, and a ValidatingAdmissionPolicy's
params are ANDed over every runtime a binding selects, so it cannot ask whether one of a given name exists.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from rlhf_api import v1alpha1 as api
from rlhf_api.runtimes import applied, default_runtime, locked_fields_set
from rlhf_api.v1alpha1.runtime import CLUSTER_RUNTIME_KIND, RUNTIME_KIND, RLHFRuntime

from . import kube
from .checks import DEPENDENCY_WAIT_SECONDS, Unrealisable, Waiting


LIST_RUNTIMES = "`kubectl get clusterrlhfruntimes,rlhfruntimes -A` lists them"


def resolve(job: api.RLHFJob, recorded: dict[str, Any] | None, client: kube.Kube,
            waited: float | None) -> tuple[api.RLHFJob, dict[str, Any] | None]:
    """The job with its runtime applied, and status.runtime to record (None: no runtime). recorded: status.runtime
    as written when the job started; waited: seconds since the job was created, None at its admission (a job not
    stored yet is refused at once, not waited for)."""
    then = "" if waited is None else ", then re-create it"  # a job refused at admission was never made
    if recorded is not None:
        return _applied(job, api.RuntimeStatus.model_validate(recorded), then), recorded
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
    return _applied(job, record, then), record.model_dump(mode="json", by_alias=True, exclude_none=True)


def _applied(job: api.RLHFJob, record: api.RuntimeStatus, then: str) -> api.RLHFJob:
    locked = locked_fields_set(job.spec, record.spec)
    if locked:
        raise Unrealisable("RuntimeFieldLocked", f"{record.kind} {record.name} sets {', '.join(locked)} for every "
                           "job made with it and locks them: remove them from this job (or ask the runtime's "
                           f"owner){then}")
    return job.model_copy(update={"spec": applied(job.spec, record.spec)})


def _named(job: api.RLHFJob, client: kube.Kube, waited: float | None) -> dict[str, Any]:
    ref, namespace = job.spec.runtime_ref, job.metadata["namespace"]
    found = client.get(ref.kind, namespace if ref.kind == RUNTIME_KIND else "", ref.name)
    if found is not None:
        return found
    where = f" in namespace {namespace}" if ref.kind == RUNTIME_KIND else ""
    missing = f"spec.runtimeRef names {ref.kind} {ref.name}, which does not exist{where}"
    if waited is None:
        raise Unrealisable("RuntimeNotFound", f"{missing}: create the runtime before the job, or name one that exists "
                           f"({LIST_RUNTIMES})")
    if waited < DEPENDENCY_WAIT_SECONDS:
        raise Waiting("RuntimeNotFound", f"{missing} yet: waiting up to {DEPENDENCY_WAIT_SECONDS}s after creation "
                      f"for it to appear ({LIST_RUNTIMES})")
    raise Unrealisable("RuntimeNotFound", f"{missing} after {DEPENDENCY_WAIT_SECONDS}s: create it or fix the name, "
                       "then re-create this job")


def _default(namespace: str, client: kube.Kube) -> dict[str, Any] | None:
    """The runtime of a job that names none (rlhf_api.runtimes.default_runtime's rule)."""
    listed = []
    for kind, where in ((RUNTIME_KIND, namespace), (CLUSTER_RUNTIME_KIND, "")):
        try:
            # a list's items carry no kind
            listed += [{**runtime, "kind": kind} for runtime in client.list(kind, where, "")]
        except ApiException as error:
            if error.status != 404:  # 404: the runtime CRDs are not installed: no runtimes
                raise
    return default_runtime(listed)
