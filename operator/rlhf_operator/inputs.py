"""The jobs a job starts from (models.<role>.fromJob): wait for them, then load their models.

A job whose inputs have not all Succeeded is Waiting (reason WaitingForJob) and makes nothing: no
ConfigMap, no RayJob, so no Kueue Workload and no quota. handlers.start_dependents reconciles it
when an input finishes or goes (watch events, no polling of its own; the resync is the safety net).
Once every input has Succeeded, its models are the inputs' status.outputModel, mounted read-only
from their checkpoint claims (rlhf_api.pipeline.on_claims). A failed input, one deleted after it was
seen, one that exports no model of the kind the role loads, or inputs that name each other in a
cycle fail the job with a reason that names them; an input never created fails it after
checks.DEPENDENCY_WAIT_SECONDS (a typo), as a missing ConfigMap does.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlhf_api import pipeline
from rlhf_api import v1alpha1 as api

from .checks import DEPENDENCY_WAIT_SECONDS
from .status import Observation

MAX_DEPTH = 64  # stages followed when looking for a cycle


class JobReads(Protocol):
    def job(self, namespace: str, name: str) -> dict[str, Any] | None: ...


def resolve(job: api.RLHFJob, seen: list[dict[str, Any]], reads: JobReads,
            age_seconds: float) -> tuple[api.RLHFJob, list[dict[str, Any]] | None] | Observation:
    """The job with its fromJob models resolved and its status.inputs (None: it has none), once every
    input has Succeeded; else what to record: Waiting, or Failed. seen: status.inputs as last written
    (an input's uid once seen)."""
    refs = pipeline.inputs(job.spec)
    if not refs:
        return job, None
    namespace = job.metadata["namespace"]
    uids = {entry["role"]: entry.get("uid") for entry in seen}
    cycle = _cycle(job, reads)  # first: the cause, whichever job of the cycle has failed already
    if cycle is not None:
        return _input_failed("InputCycle", cycle, seen)
    found_inputs, outputs, waiting = [], {}, []
    for role, ref in refs.items():
        found = reads.job(namespace, ref.name)
        uid = found["metadata"]["uid"] if found else None
        if uids.get(role) and uid != uids[role]:
            return _input_failed("InputJobDeleted", f"RLHFJob {ref.name}, whose model models.{role}.fromJob names, "
                                 "was deleted before it succeeded: re-create it (or point fromJob at another job), "
                                 "then re-create this job", found_inputs)
        status = (found or {}).get("status") or {}
        phase = status.get("phase")
        found_inputs.append(api.JobInput(role=role, name=ref.name, uid=uid, phase=phase).model_dump(exclude_none=True))
        if found is None:
            if age_seconds > DEPENDENCY_WAIT_SECONDS:
                return _input_failed("InputJobNotFound", f"RLHFJob {ref.name} (models.{role}.fromJob) does not "
                                     f"exist after {DEPENDENCY_WAIT_SECONDS} s: create it, or fix the name",
                                     found_inputs)
            waiting.append(f"RLHFJob {ref.name} (models.{role}) does not exist yet")
        elif phase == "Failed":
            return _input_failed("InputJobFailed", f"RLHFJob {ref.name}, whose model models.{role}.fromJob names, "
                                 f"failed ({status.get('reason')}: {status.get('message')}): fix and re-run it, then "
                                 "re-create this job", found_inputs)
        elif phase == "Succeeded":
            output = status.get("outputModel")
            if output is None:
                why = pipeline.unexported(api.RLHFJobSpec.model_validate(found["spec"]))
                return _input_failed("InputHasNoModel", f"RLHFJob {ref.name} (models.{role}.fromJob) succeeded "
                                     f"but exported no model another job can load: {why}", found_inputs)
            outputs[role] = api.OutputModel.model_validate(output)
            if (wrong := pipeline.problem(role, ref, outputs[role].kind, outputs[role].best is not None)) is not None:
                return _input_failed("InputModelMismatch", wrong, found_inputs)
        else:
            progress = (status.get("progress") or {}).get("summary")
            waiting.append(f"RLHFJob {ref.name} (models.{role}) is {phase or 'new'}"
                           + (f", at step {progress}" if progress else ""))
    if waiting:
        return Observation("Waiting", "WaitingForJob", "waiting for its input jobs to succeed: " + "; ".join(waiting),
                           inputs=found_inputs)
    resolved = pipeline.on_claims(job.spec, outputs).model_dump(by_alias=True, exclude_none=True)
    return api.RLHFJob.model_validate({**job.model_dump(by_alias=True), "spec": resolved}), found_inputs


def waiting_for(jobs: dict, namespace: str, name: str, uid: str | None, phase: str | None) -> list[dict[str, Any]]:
    """The Waiting jobs (of the jobs index: copies by (namespace, name)) that saw the input job `name` in
    another state than (uid, phase) now: each is to be reconciled. uid None: the input was deleted; phase
    None: it has none yet."""
    stale = []
    for (job_namespace, _), copies in list(jobs.items()):
        if job_namespace != namespace:
            continue
        for job in list(copies):
            current = job.get("status") or {}
            if current.get("phase") != "Waiting":
                continue
            seen = [entry for entry in current.get("inputs") or [] if entry["name"] == name]
            if any((entry.get("uid"), entry.get("phase")) != (uid, phase) for entry in seen):
                stale.append(job)
    return stale


def _input_failed(reason: str, message: str, found_inputs: list[dict[str, Any]]) -> Observation:
    return Observation("Failed", reason, message, warning=True, inputs=found_inputs)


def _cycle(job: api.RLHFJob, reads: JobReads) -> str | None:
    """The cycle of fromJob references this job is part of, said for humans (None: there is none)."""
    namespace, specs = job.metadata["namespace"], {job.metadata["name"]: job.spec}
    frontier = [job.spec]
    for _ in range(MAX_DEPTH):
        named = [ref.name for spec in frontier for ref in pipeline.inputs(spec).values() if ref.name not in specs]
        frontier = []
        for name in named:
            found = reads.job(namespace, name)
            if found is not None:
                try:
                    specs[name] = api.RLHFJobSpec.model_validate(found["spec"])
                except ValueError:
                    continue  # its own reconcile says what is wrong with it
                frontier.append(specs[name])
        if not frontier:
            break
    try:
        pipeline.in_order(specs)
    except pipeline.Cycle as cycle:
        return str(cycle)
    return None
