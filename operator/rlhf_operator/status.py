"""RLHFJob status from its RayJob: a small state machine, pure (the time is an argument).

`observe` reads KubeRay's RayJob status (jobDeploymentStatus, jobStatus, reason, message) into a
phase with a reason and a message for humans; `next_status` turns that into the status fields the
operator owns (phase, conditions, times, names); `transition` says whether it is worth an Event.
The trainer's fields (progress, metrics, lastCheckpoint) are never part of any of it.

| RayJob jobDeploymentStatus       | jobStatus       | phase        | reason                        |
| -------------------------------- | --------------- | ------------ | ----------------------------- |
| Complete                         | SUCCEEDED       | Succeeded    | Completed                     |
| Complete                         | STOPPED         | Failed       | Stopped                       |
| Complete                         | other           | Failed       | KubeRay's, else RayJobFailed  |
| Failed                           | any             | Failed       | KubeRay's (AppFailed, DeadlineExceeded, SubmissionFailed, ...) |
| ValidationFailed                 | any             | Failed       | RayJobInvalid                 |
| Suspended, RayJob spec.suspend   | any             | Suspended    | Suspended (Queued for Kueue)  |
| other, RayJob spec.suspend       | any             | Suspended    | Suspending                    |
| Suspending                       | any             | Suspended    | Suspending                    |
| Suspended (resume asked)         | any             | Pending      | Resuming                      |
| "" (new)                         | any             | Pending      | RayJobCreated (Retrying after a failed attempt) |
| Initializing                     | any             | Provisioning | StartingRayCluster            |
| Waiting                          | any             | Provisioning | WaitingForSubmission          |
| Running                          | "" or PENDING   | Provisioning | SubmittingJob                 |
| Running                          | RUNNING         | Running      | Training                      |
| Running                          | terminal        | Running      | Finishing                     |
| Retrying                         | any             | Provisioning | Retrying                      |

A failed run's message is the trainer's failure line (contract.RUN_FAILED) when the log tail KubeRay
quotes has one, else KubeRay's message, and its reason the failure's type where the contract declares
that a reason (contract.FAILURE_REASONS: NodeUnusable); Events are cut to the API's 1,024 bytes.
While KubeRay retries (status.failed > 0) every message says which attempt of how many it is; the
failed attempt itself (Retrying) is a Warning with the trainer's failure line.
While the Ray cluster starts, what its pods are waiting for (unschedulable, image pull...) is the
reason and message (`Observation.with_pod_problem`).

Conditions Ready, Running, Succeeded, Failed, Suspended are all present: True for Running (Ready,
Running), Succeeded (Ready, Succeeded), Failed (Failed), Suspended (Suspended), else False. A true
condition, and a false Ready or Running (why the job is not running), carries the phase's reason
and message; the other false ones say only what they deny (NotFinished, NoFailure, NotSuspended).
The operator's own refusals (bad input) are Failed too.

Succeeded and Failed are final: once there, the status no longer follows the RayJob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlhf_api import contract

TERMINAL = ("Succeeded", "Failed")
CONDITION_TYPES = ("Ready", "Running", "Succeeded", "Failed", "Suspended")
TRUE_CONDITIONS = {
    "Waiting": (),  # for its input jobs (inputs.py): nothing made yet
    "Pending": (),
    "Provisioning": (),
    "Running": ("Ready", "Running"),
    "Succeeded": ("Ready", "Succeeded"),
    "Failed": ("Failed",),
    "Suspended": ("Suspended",),
}
# The status fields the operator writes; everything else in status belongs to the trainer.
OWNED_FIELDS = (
    "phase", "reason", "message", "conditions", "observedGeneration", "rayJobName", "rayClusterName",
    "dashboardURL", "startTime", "completionTime", "keptCluster", "inputs", "outputModel", "runtime",
)
RAY_JOB_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
EVENT_MESSAGE_LIMIT = 1024  # bytes: the Events API refuses longer messages
# A false condition that the phase does not explain: (reason, message).
NEUTRAL = {
    "Succeeded": ("NotFinished", "The job has not finished"),
    "Failed": ("NoFailure", "The job has not failed"),
    "Suspended": ("NotSuspended", "The job is not suspended"),
}


@dataclass(frozen=True)
class Observation:
    phase: str
    reason: str
    message: str
    ray_job_name: str | None = None
    ray_cluster_name: str | None = None
    dashboard_url: str | None = None
    started_at: str | None = None  # KubeRay's startTime: when it began to bring up the cluster
    finished_at: str | None = None  # KubeRay's endTime
    warning: bool = False  # its Event is a Warning: something a human has to look at
    kept_cluster: dict[str, Any] | None = None  # status.keptCluster: a failed run's cluster kept for debugging
    inputs: list[dict[str, Any]] | None = None  # status.inputs (inputs.py); None: as they were
    runtime: dict[str, Any] | None = None  # status.runtime (runtimes.py); None: as it was
    output_model: dict[str, Any] | None = None  # status.outputModel, with Succeeded

    def with_pod_problem(self, problem: tuple[str, str] | None) -> Observation:
        """While the cluster starts, a pod's reason for not running (e.g. Unschedulable) is the job's."""
        if problem is None or self.phase not in ("Pending", "Provisioning"):
            return self
        return replace(self, reason=problem[0], message=f"{self.message}. {problem[1]}", warning=True)

    def with_queue_reason(self, waiting: tuple[str, str] | None) -> Observation:
        """While queued, Kueue's reason for not admitting the job (e.g. insufficient quota) in the message."""
        return self if waiting is None else replace(self, message=f"{self.message}: {waiting[1]} ({waiting[0]})")


    def with_kept_cluster(self, kept: dict[str, Any] | None) -> Observation:
        """A failed run whose cluster stays (spec.keepFailedCluster): which, until when, and how to reach it."""
        if kept is None or self.phase != "Failed":
            return self
        until = f"until {kept['until']}" if "until" in kept else "until the RLHFJob is deleted"
        return replace(self, kept_cluster=kept, message=(
            f"{self.message}. Ray cluster {kept['name']} is kept for debugging {until} (spec.keepFailedCluster): "
            "its dashboard (status.dashboardURL) and its pods' logs stay"))


@dataclass(frozen=True)
class Transition:
    """A Kubernetes Event worth posting: the job moved to another phase or reason."""

    type: str  # Normal or Warning
    reason: str
    message: str


def _trainer_failure(kuberay_message: str) -> str:
    """The trainer's own failure line from the log tail KubeRay quotes, without the job file's name."""
    said = [line for line in kuberay_message.splitlines() if contract.RUN_FAILED in line]
    return said[-1].split(contract.RUN_FAILED, 1)[1].strip() if said else ""


def _trainer_reason(said: str) -> str | None:
    """The failure's type when the contract declares it a reason (NodeUnusable: what to fix is the node's)."""
    kind = said.split(":", 1)[0]
    return kind if kind in contract.FAILURE_REASONS else None


def _verdict(ray_job: dict[str, Any], *, suspend: bool, queue_name: str | None) -> tuple[str, str, str]:
    name = ray_job["metadata"]["name"]
    status = ray_job.get("status") or {}
    deployment = status.get("jobDeploymentStatus", "")
    job_status = status.get("jobStatus", "")
    kuberay_reason = status.get("reason") or ""
    kuberay_message = status.get("message") or ""
    cluster = status.get("rayClusterName") or f"of RayJob {name}"

    if deployment == "Complete" and job_status == "SUCCEEDED":
        return "Succeeded", "Completed", "Training finished successfully"
    if deployment == "Complete" and job_status == "STOPPED":
        return "Failed", "Stopped", f"The training job was stopped before it finished. {kuberay_message}".strip()
    if deployment in ("Complete", "Failed"):
        said = _trainer_failure(kuberay_message)
        detail = (f"{said} (the log tail: kubectl get rayjob {name} -o jsonpath='{{.status.message}}')" if said
                  else kuberay_message or
                  f"KubeRay marked RayJob {name} {deployment} (Ray job status {job_status or 'unknown'})")
        return "Failed", _trainer_reason(said) or kuberay_reason or "RayJobFailed", f"Training failed: {detail}"
    if deployment == "ValidationFailed":
        return "Failed", "RayJobInvalid", f"KubeRay rejected RayJob {name}: {kuberay_message}"

    if (ray_job.get("spec") or {}).get("suspend"):
        if deployment != "Suspended":
            return "Suspended", "Suspending", "Suspending: waiting for KubeRay to release the Ray cluster"
        if queue_name and not suspend:
            return "Suspended", "Queued", f"Waiting for Kueue to admit the job from LocalQueue {queue_name}"
        return ("Suspended", "Suspended",
                "Suspended (spec.suspend is true); set it to false to resume from the newest checkpoint")

    match deployment:
        case "Suspending":
            return "Suspended", "Suspending", "Suspending: waiting for KubeRay to release the Ray cluster"
        case "Suspended":
            return "Pending", "Resuming", "Resuming: waiting for KubeRay to start a new Ray cluster"
        case "":
            return "Pending", "RayJobCreated", f"RayJob {name} created; waiting for KubeRay to start the Ray cluster"
        case "Initializing":
            return ("Provisioning", "StartingRayCluster",
                    f"Starting Ray cluster {cluster}: waiting for its pods to be scheduled and ready")
        case "Waiting":
            return "Provisioning", "WaitingForSubmission", f"Ray cluster {cluster} is ready; waiting for the job submission"
        case "Running" if job_status == "RUNNING":
            return "Running", "Training", f"Training on Ray cluster {cluster}"
        case "Running" if job_status in RAY_JOB_TERMINAL:
            return "Running", "Finishing", f"The training job ended ({job_status}); waiting for KubeRay to record the result"
        case "Running":
            return "Provisioning", "SubmittingJob", f"Ray cluster {cluster} is ready; the training job is submitted and starting"
        case "Retrying":
            said = _trainer_failure(kuberay_message) or kuberay_message  # observe says which attempt
            return ("Provisioning", "Retrying",
                    f"Retrying on a new Ray cluster from the newest checkpoint; the last attempt failed: {said}")
    return ("Provisioning", "UnknownRayJobState",
            f"KubeRay reports jobDeploymentStatus {deployment!r}, which this operator does not know")


def observe(ray_job: dict[str, Any], *, suspend: bool, queue_name: str | None) -> Observation:
    """What the RayJob says about the run. suspend and queue_name are the RLHFJob's."""
    phase, reason, message = _verdict(ray_job, suspend=suspend, queue_name=queue_name)
    status = ray_job.get("status") or {}
    failed = status.get("failed") or 0
    if failed and phase in ("Pending", "Provisioning", "Running"):
        attempts = (ray_job.get("spec") or {}).get("backoffLimit", 0) + 1
        reason = "Retrying" if reason == "RayJobCreated" else reason
        message = f"Attempt {min(failed + 1, attempts)} of {attempts} ({failed} failed): {message}"
    return Observation(
        phase=phase,
        reason=reason,
        message=message,
        ray_job_name=ray_job["metadata"]["name"],
        ray_cluster_name=status.get("rayClusterName") or None,
        dashboard_url=status.get("dashboardURL") or None,
        started_at=status.get("startTime"),
        finished_at=status.get("endTime"),
        warning=status.get("jobDeploymentStatus") == "Retrying",  # an attempt failed
    )


def _conditions(previous: list[dict[str, Any]], obs: Observation, now: str,
                generation: int | None) -> list[dict[str, Any]]:
    """metav1.Conditions: lastTransitionTime moves only when a condition's status flips."""
    before = {condition["type"]: condition for condition in previous}
    conditions = []
    for kind in CONDITION_TYPES:
        status = "True" if kind in TRUE_CONDITIONS[obs.phase] else "False"
        old = before.get(kind)
        own = status == "True" or kind in ("Ready", "Running") or (kind == "Succeeded" and obs.phase == "Failed")
        reason, message = (obs.reason, obs.message) if own else NEUTRAL[kind]
        condition = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status else now,
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        conditions.append(condition)
    # Types of others' (the trainer's contract.TRAINER_CONDITION) are kept: the list is written whole.
    return conditions + [condition for condition in previous if condition["type"] not in CONDITION_TYPES]


def owned(status: dict[str, Any]) -> dict[str, Any]:
    return {field: status.get(field) for field in OWNED_FIELDS}


def next_status(current: dict[str, Any], obs: Observation, now: str, generation: int | None) -> dict[str, Any]:
    """Every owned field as it should be (None: absent). generation None keeps observedGeneration."""
    if current.get("phase") in TERMINAL:
        return owned(current)
    observed = generation if generation is not None else current.get("observedGeneration")
    # As a batch/v1 Job's: cleared while suspended, so a resumed job's deadline starts afresh.
    started = None if obs.phase == "Suspended" else current.get("startTime")
    if started is None and (obs.phase in ("Provisioning", "Running") or (obs.phase in TERMINAL and obs.started_at)):
        started = obs.started_at or now
    completed = current.get("completionTime")
    if completed is None and obs.phase in TERMINAL:
        completed = obs.finished_at or now
    return {
        "phase": obs.phase,
        "reason": obs.reason,
        "message": obs.message,
        "conditions": _conditions(current.get("conditions") or [], obs, now, observed),
        "observedGeneration": observed,
        "rayJobName": obs.ray_job_name,
        "rayClusterName": obs.ray_cluster_name,
        "dashboardURL": obs.dashboard_url,
        "startTime": started,
        "completionTime": completed,
        "keptCluster": obs.kept_cluster,
        "inputs": obs.inputs if obs.inputs is not None else current.get("inputs"),
        "runtime": obs.runtime if obs.runtime is not None else current.get("runtime"),
        "outputModel": obs.output_model,
    }


def changes(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of the owned fields that differ (None removes a field)."""
    return {field: value for field, value in desired.items() if current.get(field) != value}


def transition(current: dict[str, Any], desired: dict[str, Any], warning: bool = False) -> Transition | None:
    if (current.get("phase"), current.get("reason")) == (desired["phase"], desired["reason"]):
        return None
    kind = "Warning" if warning or desired["phase"] == "Failed" else "Normal"
    return Transition(kind, desired["reason"], _event_message(desired["message"]))


def _event_message(message: str) -> str:
    """Cut to the Events API's limit, which counts UTF-8 bytes (a progress bar's blocks are 3 each)."""
    encoded = message.encode()
    if len(encoded) <= EVENT_MESSAGE_LIMIT:
        return message
    # A log tail: its end is the news. A character the cut splits is dropped.
    return "..." + encoded[-(EVENT_MESSAGE_LIMIT - 3):].decode(errors="ignore")


def finished(status: dict[str, Any] | None) -> bool:
    return (status or {}).get("phase") in TERMINAL


def ray_job_finished(ray_job: dict[str, Any]) -> bool:
    """KubeRay recorded the end of the run (Complete or Failed: no more retries)."""
    return (ray_job.get("status") or {}).get("jobDeploymentStatus") in ("Complete", "Failed")
