"""The status state machine: KubeRay's RayJob status -> phase, conditions, times, events."""

from __future__ import annotations

import pytest

from rlhf_api import contract
from rlhf_operator import status

T0, T1, T2 = "2026-11-22T10:00:00Z", "2026-11-22T10:05:00Z", "2026-11-22T11:00:00Z"


def ray_job(deployment: str = "", job_status: str = "", *, suspend: bool = False, **extra) -> dict:
    body = {"metadata": {"name": "ppo"}, "spec": {"suspend": suspend, "backoffLimit": 2},
            "status": {"jobDeploymentStatus": deployment, "jobStatus": job_status, **extra}}
    if not deployment and not job_status and not extra:
        del body["status"]  # as KubeRay's RayJob looks before its first reconcile
    return body


@pytest.mark.parametrize("deployment, job_status, suspend, phase, reason", [
    ("", "", False, "Pending", "RayJobCreated"),
    ("Initializing", "", False, "Provisioning", "StartingRayCluster"),
    ("Waiting", "", False, "Provisioning", "WaitingForSubmission"),
    ("Running", "", False, "Provisioning", "SubmittingJob"),
    ("Running", "PENDING", False, "Provisioning", "SubmittingJob"),
    ("Running", "RUNNING", False, "Running", "Training"),
    ("Running", "SUCCEEDED", False, "Running", "Finishing"),
    ("Complete", "SUCCEEDED", False, "Succeeded", "Completed"),
    ("Complete", "STOPPED", False, "Failed", "Stopped"),
    ("Failed", "FAILED", False, "Failed", "AppFailed"),
    ("ValidationFailed", "", False, "Failed", "RayJobInvalid"),
    ("Retrying", "FAILED", False, "Provisioning", "Retrying"),
    ("Suspending", "RUNNING", False, "Suspended", "Suspending"),
    ("Suspended", "", False, "Pending", "Resuming"),
    ("", "", True, "Suspended", "Suspending"),
    ("Running", "RUNNING", True, "Suspended", "Suspending"),
    ("Suspended", "", True, "Suspended", "Suspended"),
    ("Complete", "SUCCEEDED", True, "Succeeded", "Completed"),  # finished wins over suspend
    ("SomethingNew", "", False, "Provisioning", "UnknownRayJobState"),
])
def test_phase_mapping(deployment, job_status, suspend, phase, reason):
    extra = {"reason": "AppFailed"} if deployment == "Failed" else {}
    observed = status.observe(ray_job(deployment, job_status, suspend=suspend, **extra), suspend=suspend, queue_name=None)
    assert (observed.phase, observed.reason) == (phase, reason)
    assert observed.message


def test_failure_carries_kuberay_reason_and_message():
    failed = ray_job("Failed", "FAILED", reason="DeadlineExceeded",
                     message="The RayJob has passed the activeDeadlineSeconds.")
    observed = status.observe(failed, suspend=False, queue_name=None)
    assert observed.reason == "DeadlineExceeded"
    assert observed.message == "Training failed: The RayJob has passed the activeDeadlineSeconds."
    bare = status.observe(ray_job("Failed", "FAILED"), suspend=False, queue_name=None)
    assert bare.reason == "RayJobFailed" and "RayJob ppo" in bare.message


def test_a_failed_run_is_summed_up_by_the_trainers_failure_line():
    # KubeRay's AppFailed message carries up to 20,000 characters of the driver's log tail; the
    # trainer's last line says what broke. The status quotes that line and points at the tail, and
    # the Event stays within the API's 1,024 bytes (kopf drops a longer one, so no Event at all).
    tail = "\n".join(f"(ModelWorker pid={pid}) Loading weights: 100%" for pid in range(400))
    said = f"/etc/rlhf/job.yaml: {contract.RUN_FAILED}RewardError: reward source 'letter' failed: label set is empty"
    message = (f"Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):"
               f"\n{said}\n{tail}")
    observed = status.observe(ray_job("Failed", "FAILED", reason="AppFailed", message=message),
                              suspend=False, queue_name=None)
    assert observed.message.startswith("Training failed: RewardError: reward source 'letter' failed: label set is empty")
    assert "kubectl get rayjob ppo" in observed.message and len(observed.message) < 1024
    failed = status.next_status({}, observed, T0, 1)
    event = status.transition({"phase": "Running", "reason": "Training"}, failed)
    assert event.message == observed.message

    # No trainer line: the tail, cut to fit an Event. The API counts bytes: progress bars' blocks are 3.
    bars = "\n".join(f"(ModelWorker pid={pid}) Loading weights: 100%|██████████| 26/26" for pid in range(400))
    unknown = status.observe(ray_job("Failed", "FAILED", reason="AppFailed", message=bars),
                             suspend=False, queue_name=None)
    event = status.transition({}, status.next_status({}, unknown, T0, 1))
    assert len(event.message.encode()) <= status.EVENT_MESSAGE_LIMIT and event.message.endswith("██████████| 26/26")
    assert unknown.message == f"Training failed: {bars}"  # the status keeps all of it


@pytest.mark.parametrize("deployment", ["Failed", "Complete"])
def test_a_node_the_trainer_found_unusable_is_the_failure_s_reason(deployment):
    # KubeRay says AppFailed for any failure; the trainer's NodeUnusable says the fix is the node's.
    said = (f"/etc/rlhf/job.yaml: {contract.RUN_FAILED}{contract.NODE_UNUSABLE}: this node's NVIDIA driver runs "
            "CUDA up to 12.8, and the trainer image's torch is built for CUDA 13.0, which needs driver R580 or newer")
    observed = status.observe(ray_job(deployment, "FAILED", reason="AppFailed", message=f"exit code 1\n{said}"),
                              suspend=False, queue_name=None)
    assert (observed.phase, observed.reason) == ("Failed", "NodeUnusable")
    assert observed.message.startswith("Training failed: NodeUnusable: this node's NVIDIA driver runs CUDA up to 12.8")
    other = said.replace(contract.NODE_UNUSABLE, "RewardError")  # a type the contract does not declare a reason
    assert status.observe(ray_job(deployment, "FAILED", reason="AppFailed", message=other),
                          suspend=False, queue_name=None).reason == "AppFailed"


def test_queued_job_waits_for_kueue():
    observed = status.observe(ray_job("Suspended", suspend=True), suspend=False, queue_name="team-a")
    assert (observed.phase, observed.reason) == ("Suspended", "Queued")
    assert "team-a" in observed.message


def test_names_and_dashboard_are_mirrored():
    observed = status.observe(ray_job("Running", "RUNNING", rayClusterName="ppo-abcde",
                                      dashboardURL="ppo-head-svc.ns.svc.cluster.local:8265"),
                              suspend=False, queue_name=None)
    desired = status.next_status({}, observed, T0, 1)
    assert desired["rayJobName"] == "ppo"
    assert desired["rayClusterName"] == "ppo-abcde"
    assert desired["dashboardURL"] == "ppo-head-svc.ns.svc.cluster.local:8265"
    assert "ppo-abcde" in desired["message"]


def conditions(desired: dict) -> dict:
    return {c["type"]: c for c in desired["conditions"]}


def walk(*steps: tuple[dict, str], generation: int = 1) -> list[dict]:
    """Feed RayJob states through the machine as the operator does; the status after each step."""
    current: dict = {}
    seen = []
    for body, now in steps:
        observed = status.observe(body, suspend=body["spec"]["suspend"], queue_name=None)
        current = {**current, **status.changes(current, status.next_status(current, observed, now, generation))}
        seen.append(current)
    return seen


def test_conditions_follow_the_phase_and_keep_their_transition_time():
    pending, provisioning, running, running_later, done = walk(
        (ray_job(), T0),
        (ray_job("Initializing"), T0),
        (ray_job("Running", "RUNNING"), T1),
        (ray_job("Running", "RUNNING", message="still going"), T2),
        (ray_job("Complete", "SUCCEEDED"), T2),
    )
    assert {t: c["status"] for t, c in conditions(pending).items()} == {
        "Ready": "False", "Running": "False", "Succeeded": "False", "Failed": "False", "Suspended": "False"}
    assert conditions(running)["Running"] == {
        "type": "Running", "status": "True", "reason": "Training", "message": running["message"],
        "lastTransitionTime": T1, "observedGeneration": 1}
    assert conditions(running)["Ready"]["status"] == "True"
    assert conditions(running)["Failed"]["lastTransitionTime"] == T0  # never flipped
    assert conditions(running_later)["Running"]["lastTransitionTime"] == T1
    assert {t for t, c in conditions(done).items() if c["status"] == "True"} == {"Ready", "Succeeded"}
    assert conditions(done)["Running"]["lastTransitionTime"] == T2


def test_the_trainer_s_condition_is_kept_when_the_operator_writes_its_own():
    stalled = {"type": contract.TRAINER_CONDITION, "status": "True", "reason": "NoLearningSignal", "message": "...",
               "lastTransitionTime": T0}
    current = {"conditions": [stalled]}
    observed = status.observe(ray_job("Running", "RUNNING"), suspend=False, queue_name=None)
    written = status.next_status(current, observed, T1, 1)["conditions"]
    assert [c["type"] for c in written] == [*status.CONDITION_TYPES, contract.TRAINER_CONDITION]
    assert written[-1] == stalled  # as the trainer wrote it


def test_start_and_completion_times():
    pending, provisioning, running, done = walk(
        (ray_job(), T0),
        (ray_job("Initializing", startTime=T0), T1),
        (ray_job("Running", "RUNNING", startTime=T0), T1),
        (ray_job("Complete", "SUCCEEDED", startTime=T0, endTime=T2), T2),
    )
    assert pending.get("startTime") is None and pending.get("completionTime") is None
    assert provisioning["startTime"] == running["startTime"] == done["startTime"] == T0
    assert running.get("completionTime") is None
    assert done["completionTime"] == T2


def test_a_job_that_never_ran_gets_no_start_time():
    desired = status.next_status({}, status.Observation("Failed", "TooManyGPUsPerNode", "fix it"), T1, 3)
    assert desired["startTime"] is None
    assert desired["completionTime"] == T1
    assert desired["observedGeneration"] == 3
    assert desired["rayJobName"] is None


def test_finished_jobs_are_final():
    [done] = walk((ray_job("Complete", "SUCCEEDED"), T1))
    later = status.observe(ray_job("Failed", "FAILED"), suspend=False, queue_name=None)
    assert status.changes(done, status.next_status(done, later, T2, 2)) == {}


def test_only_operator_fields_are_ever_written():
    trainer_wrote = {"progress": {"step": 5, "totalSteps": 10}, "metrics": {"rewardMean": 0.5},
                     "lastCheckpoint": {"step": 5, "path": "/c/5", "time": T0}}
    observed = status.observe(ray_job("Running", "RUNNING"), suspend=False, queue_name=None)
    patch = status.changes(trainer_wrote, status.next_status(trainer_wrote, observed, T1, 1))
    assert set(patch) <= set(status.OWNED_FIELDS)
    assert not {"progress", "metrics", "lastCheckpoint"} & set(patch)


def test_events_on_transitions_only():
    pending, running, running_again, failed = walk(
        (ray_job(), T0), (ray_job("Running", "RUNNING"), T1), (ray_job("Running", "RUNNING"), T2),
        (ray_job("Failed", "FAILED", reason="AppFailed", message="exit code 1"), T2))
    assert status.transition({}, pending).reason == "RayJobCreated"
    assert status.transition(pending, running) == status.Transition("Normal", "Training", running["message"])
    assert status.transition(running, running_again) is None
    assert status.transition(running_again, failed) == status.Transition(
        "Warning", "AppFailed", "Training failed: exit code 1")


def test_generation_is_kept_when_not_given():
    observed = status.observe(ray_job("Running", "RUNNING"), suspend=False, queue_name=None)
    desired = status.next_status({"observedGeneration": 4}, observed, T0, None)
    assert desired["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 for c in desired["conditions"])


def test_a_false_condition_does_not_borrow_the_phase_reason():
    """Succeeded=False reason=Training read as if training were why it had not succeeded."""
    [running] = walk((ray_job("Running", "RUNNING"), T1))
    assert {t: (c["status"], c["reason"]) for t, c in conditions(running).items()} == {
        "Ready": ("True", "Training"), "Running": ("True", "Training"), "Succeeded": ("False", "NotFinished"),
        "Failed": ("False", "NoFailure"), "Suspended": ("False", "NotSuspended")}
    [starting] = walk((ray_job("Initializing"), T1))
    assert conditions(starting)["Ready"]["reason"] == "StartingRayCluster"  # why it is not ready
    [failed] = walk((ray_job("Failed", "FAILED", reason="AppFailed"), T1))
    assert conditions(failed)["Succeeded"]["reason"] == conditions(failed)["Failed"]["reason"] == "AppFailed"


def test_a_failed_attempt_kuberay_retries_is_a_warning_with_the_trainers_failure_line():
    # Retrying carries the same log tail as Failed: the Event (cut to 1,024 characters) must still
    # say which attempt comes next and what broke, as a Warning.
    tail = "\n".join(f"(ModelWorker pid={pid}) Loading weights: 100%" for pid in range(400))
    said = f"/etc/rlhf/job.yaml: {contract.RUN_FAILED}ActorDiedError: The actor died unexpectedly"
    retrying = ray_job("Retrying", "FAILED", reason="AppFailed", failed=1, message=f"exit code 1\n{said}\n{tail}")
    observed = status.observe(retrying, suspend=False, queue_name=None)
    assert observed.warning and observed.message.startswith("Attempt 2 of 3 (1 failed): Retrying on a new Ray cluster")
    assert observed.message.endswith("ActorDiedError: The actor died unexpectedly")
    event = status.transition({"phase": "Running", "reason": "Training"}, status.next_status({}, observed, T0, 1),
                              warning=observed.warning)
    assert (event.type, event.message) == ("Warning", observed.message)


@pytest.mark.parametrize("deployment, reason", [("", "Retrying"), ("Initializing", "StartingRayCluster"),
                                                ("Running", "SubmittingJob")])
def test_after_a_retry_every_message_names_the_attempt(deployment, reason):
    """KubeRay resets jobDeploymentStatus to "" after a failed attempt; the count stays in status.failed."""
    observed = status.observe(ray_job(deployment, failed=1), suspend=False, queue_name=None)
    assert observed.reason == reason
    assert observed.message.startswith("Attempt 2 of 3 (1 failed): ")


def test_a_pod_problem_is_the_reason_of_a_starting_job_and_a_warning():
    problem = ("Unschedulable", 'pod ppo-head: persistentvolumeclaim "rlhf-checkpoints" not found')
    starting = status.observe(ray_job("Initializing"), suspend=False, queue_name=None).with_pod_problem(problem)
    assert starting.reason == "Unschedulable" and starting.warning
    assert starting.message.endswith('persistentvolumeclaim "rlhf-checkpoints" not found')
    desired = status.next_status({}, starting, T0, 1)
    assert status.transition({}, desired, warning=starting.warning).type == "Warning"
    running = status.observe(ray_job("Running", "RUNNING"), suspend=False, queue_name=None)
    assert running.with_pod_problem(problem) == running  # a running job's pods are the trainer's business


def test_a_queued_job_says_why_kueue_has_not_admitted_it():
    queued = status.observe(ray_job("Suspended", suspend=True), suspend=False, queue_name="team-a")
    said = queued.with_queue_reason(("Pending", "couldn't assign flavors: insufficient quota for nvidia.com/gpu"))
    assert said.reason == "Queued" and said.message.endswith("insufficient quota for nvidia.com/gpu (Pending)")


def test_start_time_is_cleared_while_suspended_so_a_resumed_deadline_starts_afresh():
    running, suspended, resumed = walk((ray_job("Running", "RUNNING", startTime=T0), T0),
                                       (ray_job("Suspended", suspend=True), T1),
                                       (ray_job("Initializing", startTime=T2), T2))
    assert running["startTime"] == T0 and suspended["startTime"] is None and resumed["startTime"] == T2
