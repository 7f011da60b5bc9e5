"""The operator on a real control plane: children, status following KubeRay, suspend, TTL, deletion.

RayJob status is written here as KubeRay writes it (e2e/operator/kuberay.py explains the seam),
with the real KubeRay operator paused so that it does not write its own.
"""

from __future__ import annotations

import yaml

from kubernetes.client.exceptions import ApiException

from e2e.fixtures import wait_for
from e2e.operator.jobs import (
    children, create_job, events, get_job, rlhf_job, touch_and_wait_reconciled, wait_events, wait_gone,
    wait_phase,
)
from e2e.operator.kuberay import RayJobStatus
from rlhf_operator import names
from rlhf_api import contract
from rlhf_api import v1alpha1 as api


def start_job(kube, namespace, operator, name="tiny", **spec):
    operator.start()
    created = create_job(kube, namespace, rlhf_job(name, **spec))
    job = wait_phase(kube, namespace, name, "Pending", "RayJobCreated")
    return created, job, RayJobStatus(kube, namespace, names.ray_job(name))


def event_reasons(kube, namespace, name):
    return [event["reason"] for event in events(kube, namespace, name)]


def test_children_are_created_owned_and_pending(kube, namespace, operator, kuberay_paused):
    created, job, _ = start_job(kube, namespace, operator)
    uid = created["metadata"]["uid"]
    found = children(kube, namespace, "tiny")
    assert {kind: [o["metadata"]["name"] for o in objs] for kind, objs in found.items()} == {
        "ConfigMap": ["tiny-config"], "ServiceAccount": ["tiny-trainer"], "Role": ["tiny-trainer"],
        "RoleBinding": ["tiny-trainer"], "RayJob": ["tiny"]}
    for objs in found.values():
        assert [ref["uid"] for ref in objs[0]["metadata"]["ownerReferences"]] == [uid]
    config = yaml.safe_load(found["ConfigMap"][0]["data"][contract.JOB_CONFIG_FILE])
    assert config["metadata"] == {"name": "tiny", "namespace": namespace, "uid": uid}
    assert config["spec"]["training"]["zeroStage"] == 3  # defaults applied
    ray_job = found["RayJob"][0]
    assert ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == "tiny-trainer"

    status = job["status"]
    assert status["rayJobName"] == "tiny"
    # The RayJob's creation event may be mirrored into the status before the reconcile that created it
    # writes its own (seen under load: Pending/RayJobCreated with no observedGeneration yet): wait for it.
    wait_for(lambda: (found := get_job(kube, namespace, "tiny"))["status"].get("observedGeneration")
             == found["metadata"]["generation"], 30, "the reconcile's observedGeneration")
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "False", "Running": "False", "Succeeded": "False", "Failed": "False", "Suspended": "False"}
    wait_for(lambda: "RayJobCreated" in event_reasons(kube, namespace, "tiny"), 30, "the RayJobCreated event")
    assert not job["metadata"].get("finalizers")  # no operator is needed to delete it (resync.py says why)
    # kopf writes its annotations once the handler has returned, after the status: wait for them.
    wait_for(lambda: any(key.startswith("rlhf.dev/") for key in
                         get_job(kube, namespace, "tiny")["metadata"].get("annotations") or {}), 30, "kopf's annotations")


def test_phases_conditions_events_and_times_follow_the_ray_job(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    provisioning = wait_phase(kube, namespace, "tiny", "Provisioning", "StartingRayCluster")["status"]
    assert provisioning["rayClusterName"] == "tiny-abcde"
    assert provisioning["startTime"]
    ray_job.submitted()
    wait_phase(kube, namespace, "tiny", "Provisioning", "SubmittingJob")
    ray_job.running()
    running = wait_phase(kube, namespace, "tiny", "Running", "Training")["status"]
    assert running["dashboardURL"].startswith("tiny-head-svc.")
    conditions = {c["type"]: c for c in running["conditions"]}
    assert conditions["Running"]["status"] == conditions["Ready"]["status"] == "True"

    # The trainer reports progress; the operator must leave it alone from here on.
    progress = {"step": 3, "totalSteps": 10, "percent": 30.0, "summary": "3/10"}
    kube.patch(api.KIND, namespace, "tiny", {"status": {"progress": progress, "metrics": {"rewardMean": 0.25}}},
               subresource="status")
    ray_job.succeeded()
    done = wait_phase(kube, namespace, "tiny", "Succeeded", "Completed")["status"]
    assert done["progress"] == progress and done["metrics"] == {"rewardMean": 0.25}
    assert done["completionTime"] >= done["startTime"] == provisioning["startTime"]
    conditions = {c["type"]: c for c in done["conditions"]}
    assert {t for t, c in conditions.items() if c["status"] == "True"} == {"Ready", "Succeeded"}
    assert conditions["Running"]["lastTransitionTime"] >= conditions["Ready"]["lastTransitionTime"]

    expected = ["RayJobCreated", "StartingRayCluster", "SubmittingJob", "Training", "Completed"]
    wait_for(lambda: event_reasons(kube, namespace, "tiny") == expected, 30, f"events {expected}")
    messages = {e["reason"]: e["message"] for e in events(kube, namespace, "tiny")}
    assert messages["RayJobCreated"] == "RayJob tiny created; waiting for KubeRay to start the Ray cluster"


def test_failed_run_carries_kuberays_reason_and_message(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")
    ray_job.failed("AppFailed", "Job entrypoint command failed with exit code 1")
    failed = wait_phase(kube, namespace, "tiny", "Failed", "AppFailed")["status"]
    assert failed["message"] == "Training failed: Job entrypoint command failed with exit code 1"
    assert {c["type"] for c in failed["conditions"] if c["status"] == "True"} == {"Failed"}
    assert failed["completionTime"]

    [event] = wait_events(kube, namespace, "tiny", lambda e: e["reason"] == "AppFailed", "the AppFailed event")
    assert event["type"] == "Warning" and event["message"] == failed["message"]


def test_suspend_and_resume_go_through_the_ray_job(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")

    kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": True}})
    wait_for(lambda: kube.get("RayJob", namespace, "tiny")["spec"]["suspend"] is True, 30, "RayJob suspend")
    wait_phase(kube, namespace, "tiny", "Suspended", "Suspending")
    ray_job.suspending()
    ray_job.suspended()
    wait_phase(kube, namespace, "tiny", "Suspended", "Suspended")
    # The status records the suspension's generation once the reconcile that suspended the RayJob writes it
    # (a RayJob event may bring the phase first): waited for, not read at once.
    suspended = wait_for(lambda: (job := get_job(kube, namespace, "tiny"))["status"].get("observedGeneration")
                         == job["metadata"]["generation"] and job, 60, "observedGeneration to reach the suspension")
    assert suspended["status"]["phase"] == "Suspended"
    assert {c["type"] for c in suspended["status"]["conditions"] if c["status"] == "True"} == {"Suspended"}
    assert "rayClusterName" not in suspended["status"]

    kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": False}})
    wait_for(lambda: kube.get("RayJob", namespace, "tiny")["spec"]["suspend"] is False, 30, "RayJob resume")
    wait_phase(kube, namespace, "tiny", "Pending", "Resuming")
    ray_job.new()
    ray_job.initializing()
    wait_phase(kube, namespace, "tiny", "Provisioning", "StartingRayCluster")


def test_a_resume_reaches_the_ray_job_after_the_suspension_s_handler_failed_past_suspending_it(
        control_plane, kube, namespace, operator, kuberay_paused):
    """The defect a loaded run showed (test_security): the handler of `suspend: true` suspended the RayJob,
    then failed writing the job's status (there, conflicts with other writers; here, a policy refusing
    every status write of the job). kopf records a change as handled only when its handler succeeds, so the
    resume that followed made the spec equal to what kopf had last recorded: kopf saw nothing to do, and
    the RayJob stayed suspended until a resync (an hour here). Every event of the job now realigns its
    RayJob with its spec."""
    operator.start("--resync-seconds", "3600")
    create_job(kube, namespace, rlhf_job("tiny"))
    wait_phase(kube, namespace, "tiny", "Pending", "RayJobCreated")
    ray_job = RayJobStatus(kube, namespace, names.ray_job("tiny"))
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")

    policy = f"e2e-no-status-{namespace}"
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
             "apiGroups": [api.GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
             "resources": [f"{api.PLURAL}/status"]}]},
             "validations": [{"expression": f"object.metadata.namespace != '{namespace}'",
                              "message": "the test refuses this job's status writes"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy}, "spec": {"policyName": policy, "validationActions": ["Deny"]}},
    ]))
    try:
        refused = {"status": {"message": "probe"}}
        wait_for(lambda: _refused(kube, namespace, refused), 30, "the policy to refuse the job's status writes")
        kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": True}})
        wait_for(lambda: kube.get("RayJob", namespace, "tiny")["spec"]["suspend"] is True, 30, "RayJob suspend")
        kube.patch(api.KIND, namespace, "tiny", {"spec": {"suspend": False}})
    finally:
        control_plane.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy)
    wait_for(lambda: kube.get("RayJob", namespace, "tiny")["spec"]["suspend"] is False, 60, "RayJob resume")


def _refused(kube, namespace: str, patch: dict) -> bool:
    """Whether the API server refuses this status patch of job tiny (an admission policy's Deny)."""
    try:
        kube.patch(api.KIND, namespace, "tiny", patch, subresource="status")
    except ApiException as error:
        return error.status in (400, 403, 422)
    return False


def test_queued_job_starts_suspended_for_kueue(kube, namespace, operator, kuberay_paused):
    operator.start()
    create_job(kube, namespace, rlhf_job("queued", queueName="team-a"))
    ray_job = wait_for(lambda: kube.get("RayJob", namespace, "queued"), 30, "the RayJob")
    assert ray_job["spec"]["suspend"] is True
    assert ray_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    RayJobStatus(kube, namespace, "queued").suspended()
    wait_phase(kube, namespace, "queued", "Suspended", "Queued")
    # Kueue admits the job by clearing the flag; the operator must not set it back.
    kube.patch("RayJob", namespace, "queued", {"spec": {"suspend": False}})
    RayJobStatus(kube, namespace, "queued").new()
    wait_phase(kube, namespace, "queued", "Pending", "RayJobCreated")
    touch_and_wait_reconciled(kube, namespace, "queued")
    assert kube.get("RayJob", namespace, "queued")["spec"]["suspend"] is False


def test_ttl_after_finish_deletes_the_job_and_its_children(kube, namespace, operator, kuberay_paused):
    created, _, ray_job = start_job(kube, namespace, operator, ttlSecondsAfterFinished=2)
    ray_job.initializing()
    ray_job.running()
    ray_job.succeeded()
    wait_gone(kube, api.KIND, namespace, "tiny")
    # It succeeded before the TTL removed it: its Completed event says so, which outlives the job (a poll of the
    # status could miss a Succeeded that lasted 2 s on a loaded machine: the whole suite's run of 2026-11-28 did).
    wait_events(kube, namespace, "tiny", lambda e: e["reason"] == "Completed", "a Completed event")
    # The garbage collector follows the owner references.
    for kind, name in [("RayJob", "tiny"), ("ConfigMap", "tiny-config"), ("ServiceAccount", "tiny-trainer"),
                       ("Role", "tiny-trainer"), ("RoleBinding", "tiny-trainer")]:
        wait_gone(kube, kind, namespace, name)


def test_ray_job_deleted_out_of_band_is_recreated_while_the_job_runs(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")
    delete_and_wait_recreated(kube, namespace)


def delete_and_wait_recreated(kube, namespace):
    """Delete job tiny's RayJob out of band; the operator makes a new one and says so, and the job waits for it."""
    old = kube.get("RayJob", namespace, "tiny")
    kube.delete("RayJob", namespace, "tiny", old["metadata"]["uid"])

    def recreated():
        now = kube.get("RayJob", namespace, "tiny")
        return now if now and now["metadata"]["uid"] != old["metadata"]["uid"] else None

    wait_for(recreated, 30, "a new RayJob")
    wait_phase(kube, namespace, "tiny", "Pending", "RayJobCreated")
    [deleted] = wait_events(kube, namespace, "tiny", lambda e: e["reason"] == "RayJobDeleted", "the RayJobDeleted event")
    assert deleted["type"] == "Warning" and "recreating" in deleted["message"]
    assert len(children(kube, namespace, "tiny")["RayJob"]) == 1


def test_a_ray_job_deleted_while_kuberay_retries_is_recreated_not_failed(kube, namespace, operator, kuberay_paused,
                                                                       trainer):
    """The failed attempt's trainer reported Failed; that report stays until the next attempt's
    trainer clears it, and must not fail a job KubeRay was retrying."""
    _, _, ray_job = start_job(kube, namespace, operator, backoffLimit=1)
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")
    trainer.patch(api.KIND, namespace, "tiny", {"status": {"progress": {
        "step": 2, "totalSteps": 9, "summary": "2/9", "result": "Failed"}}}, subresource="status")
    ray_job.ray_job_failed("exit 1")  # attempt 1 of 2: Retrying
    wait_phase(kube, namespace, "tiny", "Provisioning", "Retrying")
    delete_and_wait_recreated(kube, namespace)


def test_ray_job_deleted_after_the_job_finished_stays_deleted(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    ray_job.succeeded()
    wait_phase(kube, namespace, "tiny", "Succeeded")
    kube.delete("RayJob", namespace, "tiny", kube.get("RayJob", namespace, "tiny")["metadata"]["uid"])
    deleted = wait_events(kube, namespace, "tiny", lambda e: e["reason"] == "RayJobDeleted", "the RayJobDeleted event")
    assert "not recreated" in deleted[0]["message"]
    assert kube.get("RayJob", namespace, "tiny") is None  # the operator had handled the deletion: no new one
    assert get_job(kube, namespace, "tiny")["status"]["phase"] == "Succeeded"


def test_deleting_the_job_cascades_to_its_children(kube, namespace, operator, kuberay_paused):
    created, _, _ = start_job(kube, namespace, operator)
    kube.delete(api.KIND, namespace, "tiny", created["metadata"]["uid"])
    wait_gone(kube, api.KIND, namespace, "tiny")
    for kind, objs in children(kube, namespace, "tiny").items():
        for obj in objs:
            wait_gone(kube, kind, namespace, obj["metadata"]["name"])


def test_a_job_deleted_while_no_operator_runs_is_gone_at_once(kube, namespace, operator, kuberay_paused):
    """No finalizer on a job the operator has no timer for: deleting it (e.g. after an uninstall)
    does not leave it Terminating until an operator comes back; the garbage collector takes its children."""
    created, _, _ = start_job(kube, namespace, operator)
    operator.stop()
    kube.delete(api.KIND, namespace, "tiny", created["metadata"]["uid"])
    wait_gone(kube, api.KIND, namespace, "tiny", timeout=15)
    wait_gone(kube, "RayJob", namespace, "tiny")


def test_the_resync_restores_a_status_that_no_event_would(kube, namespace, operator, kuberay_paused):
    """A status write by someone else (or a lost event) brings no event the operator reconciles on;
    the resync (--resync-seconds) mirrors the RayJob again."""
    operator.start("--resync-seconds", "2")
    create_job(kube, namespace, rlhf_job("tiny"))
    wait_phase(kube, namespace, "tiny", "Pending", "RayJobCreated")
    kube.patch(api.KIND, namespace, "tiny", {"status": {"phase": "Running", "reason": "WrittenByHand"}},
               subresource="status")
    wait_phase(kube, namespace, "tiny", "Pending", "RayJobCreated", timeout=30)


def test_metrics_and_health(kube, namespace, operator, kuberay_paused):
    _, _, ray_job = start_job(kube, namespace, operator)
    ray_job.initializing()
    ray_job.running()
    wait_phase(kube, namespace, "tiny", "Running")
    wait_for(lambda: 'rlhf_operator_jobs{phase="Running"} 1.0' in operator.metrics(), 30, "jobs{phase=Running} 1")
    text = operator.metrics()
    assert 'rlhf_operator_reconcile_duration_seconds_count{handler="reconcile"}' in text
    assert operator.healthy()
