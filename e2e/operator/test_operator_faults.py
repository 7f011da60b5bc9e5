"""What users' clusters do to a job, met by reconcile in-process on the real control plane: a
ConfigMap applied after its job, a newer operator with a stricter rule, a RayJob deleted before its
end was mirrored, KubeRay not installed, a deadline spanning retries. Each test failed before the
fix it names."""

from __future__ import annotations

from datetime import timedelta

import kopf
import pytest

from e2e.operator.inprocess import phase, posted
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_gone
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import v1alpha1 as api
from rlhf_api.validation import FieldError, InvalidJob
from rlhf_operator import kube as operator_kube
from rlhf_operator import lifecycle, names, reconcile

pytestmark = pytest.mark.usefixtures("operator_client")


def grpo_job(name: str, reward_config_map: str, **spec) -> dict:
    return rlhf_job(name, algorithm="grpo", data={"prompts": {"sources": [{"path": "org/prompts"}]}},
                    reward={"sources": [{"name": "letter", "type": "function", "function": {
                        "entrypoint": "reward.py:score", "configMap": reward_config_map}}]},
                    rollout={"samplesPerPrompt": 2}, training={"rolloutBatchSize": 2, "trainBatchSize": 4}, **spec)


def ray_job_of(kube, namespace: str, name: str) -> dict | None:
    return kube.get("RayJob", namespace, names.ray_job(name))


def test_a_reward_config_map_applied_after_the_job_is_waited_for(kube, namespace):
    """`kubectl apply -f dir/` applies in name order; the job used to fail for good."""
    created = create_job(kube, namespace, grpo_job("early", "zz-reward"))
    with pytest.raises(kopf.TemporaryError):
        reconcile.reconcile(kopf.Body(created))
    status = get_job(kube, namespace, "early")["status"]
    assert (status["phase"], status["reason"]) == ("Pending", "RewardConfigMapNotFound")
    assert "zz-reward" in status["message"] and "waiting up to" in status["message"]
    assert ray_job_of(kube, namespace, "early") is None

    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "zz-reward", "namespace": namespace},
                 "data": {"reward.py": "def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n"}})
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "early")))
    assert phase(get_job(kube, namespace, "early")) == ("Pending", "RayJobCreated")
    assert ray_job_of(kube, namespace, "early") is not None
    assert posted(kube, created) == [("Warning", "RewardConfigMapNotFound"), ("Normal", "RayJobCreated")]


def test_a_stricter_operator_follows_a_running_job_instead_of_failing_it(kube, namespace, monkeypatch):
    """A newer release's rule used to mark a running job Failed (final) while its RayJob kept training."""
    created = create_job(kube, namespace, rlhf_job("running"))
    reconcile.reconcile(kopf.Body(created))
    RayJobStatus(kube, namespace, names.ray_job("running")).running()

    def stricter(manifest: dict) -> api.RLHFJob:
        raise InvalidJob([FieldError("spec.training.learningRate", "a rule this release added")])

    monkeypatch.setattr(reconcile, "validate", stricter)
    monkeypatch.setattr(reconcile, "_validated", reconcile.Kept())  # a new release is a new process: nothing validated yet
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "running")))
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "running")))  # a resync: warned once
    assert phase(get_job(kube, namespace, "running")) == ("Running", "Training")
    assert not ray_job_of(kube, namespace, "running")["spec"]["suspend"]
    assert posted(kube, created) == [("Normal", "RayJobCreated"), ("Warning", "SpecNoLongerValid"),
                                     ("Normal", "Training")]


def test_a_ray_job_deleted_after_it_completed_is_not_rerun(kube, namespace):
    """KubeRay's deletion policy (or a person) removed a Complete RayJob before the operator mirrored it."""
    created = create_job(kube, namespace, rlhf_job("done"))
    reconcile.reconcile(kopf.Body(created))
    status = RayJobStatus(kube, namespace, names.ray_job("done"))
    status.running()
    final = status.succeeded()
    kube.delete("RayJob", namespace, final["metadata"]["name"], final["metadata"]["uid"])
    wait_gone(kube, "RayJob", namespace, final["metadata"]["name"])
    reconcile.on_ray_job_event("DELETED", final)
    assert phase(get_job(kube, namespace, "done")) == ("Succeeded", "Completed")
    assert ray_job_of(kube, namespace, "done") is None


def test_a_run_the_trainer_reported_finished_is_not_rerun_when_its_ray_job_is_gone(kube, namespace, trainer):
    """The operator was down while the run ended and its RayJob went: the trainer's report decides."""
    created = create_job(kube, namespace, rlhf_job("quiet"))
    reconcile.reconcile(kopf.Body(created))
    ray_job = ray_job_of(kube, namespace, "quiet")
    trainer.patch(api.KIND, namespace, "quiet", {"status": {"progress": {
        "step": 3, "totalSteps": 3, "summary": "3/3", "result": "Succeeded"}}}, subresource="status")
    kube.delete("RayJob", namespace, ray_job["metadata"]["name"], ray_job["metadata"]["uid"])
    wait_gone(kube, "RayJob", namespace, ray_job["metadata"]["name"])
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "quiet")))
    status = get_job(kube, namespace, "quiet")["status"]
    assert (status["phase"], status["reason"]) == ("Succeeded", "RayJobGone") and "3/3" in status["message"]
    assert ray_job_of(kube, namespace, "quiet") is None


def test_without_kuberay_the_job_waits_and_says_why(kube, namespace):
    """The RayJob create used to raise with no phase or event saying why."""
    created = create_job(kube, namespace, rlhf_job("nokuberay"))
    with pytest.MonkeyPatch.context() as no_kuberay:  # the API server answers 404, as without KubeRay's CRDs
        no_kuberay.setitem(operator_kube.RESOURCES, "RayJob", ("/apis/ray.io/v0notserved", "rayjobs"))
        with pytest.raises(kopf.TemporaryError):
            reconcile.reconcile(kopf.Body(created))
    status = get_job(kube, namespace, "nokuberay")["status"]
    assert (status["phase"], status["reason"]) == ("Pending", "KubeRayNotInstalled")
    assert "install KubeRay" in status["message"]
    assert len(kube.list("ConfigMap", namespace, "rlhf.dev/job=nokuberay")) == 1  # what could be made was made
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "nokuberay")))  # KubeRay installed meanwhile
    assert phase(get_job(kube, namespace, "nokuberay")) == ("Pending", "RayJobCreated")


def test_the_deadline_spans_kuberay_s_retries(kube, namespace, monkeypatch):
    """KubeRay restarts activeDeadlineSeconds with every attempt: (backoffLimit+1) x the deadline.
    The operator's clock is the test's: a slow machine must not pass the deadline before it is checked."""
    clock = [lifecycle.now()]
    monkeypatch.setattr(lifecycle, "now", lambda: clock[0])
    created = create_job(kube, namespace, rlhf_job("slow", activeDeadlineSeconds=3, backoffLimit=2))
    reconcile.reconcile(kopf.Body(created))
    ray_status = RayJobStatus(kube, namespace, names.ray_job("slow"))
    reconcile.on_ray_job_event(None, ray_status.initializing())
    started = get_job(kube, namespace, "slow")["status"]["startTime"]
    ray_status.failed("AppFailed", "exit 1")
    reconcile.on_ray_job_event(None, ray_status.new())  # KubeRay's retry: back to New, status.failed kept
    status = get_job(kube, namespace, "slow")["status"]
    assert status["startTime"] == started and status["message"].startswith("Attempt 2 of 3 (1 failed)")
    reconcile.deadline_passed(namespace, "slow", created["metadata"]["uid"])  # too early: nothing happens
    assert phase(get_job(kube, namespace, "slow"))[0] == "Pending"
    # Past the deadline counted from the start KubeRay recorded (its clock, taken after this test's: on a
    # loaded machine the creation and first reconcile took over a second, and the clock + 4 s fell short).
    clock[0] = lifecycle.parse(started) + timedelta(seconds=4)
    reconcile.deadline_passed(namespace, "slow", created["metadata"]["uid"])
    status = get_job(kube, namespace, "slow")["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "DeadlineExceeded") and "3s" in status["message"]
    wait_gone(kube, "RayJob", namespace, names.ray_job("slow"))
