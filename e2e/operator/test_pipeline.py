"""Pipelines on a real control plane: a job whose model is another job's (models.<role>.fromJob) waits for
it, makes nothing meanwhile, starts on the input's success event and loads the input's model from the
input's checkpoint claim; an input that fails, goes, or cannot give the model fails it with a reason
that names the input. RayJob status is written as KubeRay writes it (kuberay.py), KubeRay paused.
The operator resyncs once an hour here: only watch events can move a waiting job."""

from __future__ import annotations

import yaml

from e2e.fixtures import wait_for
from e2e.operator.jobs import children, create_job, get_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import contract
from rlhf_api import v1alpha1 as api
from rlhf_operator import lifecycle, names

PREFERENCES = {"preferences": {"sources": [{"path": "org/tiny-pairs"}]}}


def _stage(name: str, input_name: str, role: str = "actor", **spec) -> dict:
    """A dpo job whose `role` model is `input_name`'s."""
    models = {"actor": {"path": "org/tiny-model"}, role: {"fromJob": {"name": input_name}}}
    return rlhf_job(name, algorithm="dpo", models=models, data=PREFERENCES, **spec)


def _made(kube, namespace, name) -> dict:
    return {kind: [o["metadata"]["name"] for o in objs] for kind, objs in children(kube, namespace, name).items() if objs}


def _succeed(kube, namespace, name, step: int = 3) -> dict:
    progress = {"step": step, "totalSteps": step, "percent": 100.0, "summary": f"{step}/{step}"}
    kube.patch(api.KIND, namespace, name, {"status": {"progress": progress}}, subresource="status")
    RayJobStatus(kube, namespace, names.ray_job(name)).succeeded()
    return wait_phase(kube, namespace, name, "Succeeded", "Completed")


def test_a_stage_waits_for_its_input_and_then_loads_the_input_s_model_from_its_claim(
        kube, namespace, operator, kuberay_paused):
    operator.start("--resync-seconds", "3600")
    # Applied at once, the later stage first (kubectl apply -f dir/ goes in name order).
    create_job(kube, namespace, _stage("dpo", "sft"))
    waiting = wait_phase(kube, namespace, "dpo", "Waiting", "WaitingForJob")["status"]
    assert "RLHFJob sft (models.actor) does not exist yet" in waiting["message"]
    create_job(kube, namespace, rlhf_job("sft", checkpoint={"pvc": "stages"}))
    sft = wait_phase(kube, namespace, "sft", "Pending", "RayJobCreated")
    # Each move of the input's phase reconciles the waiting job (new, then Pending).
    waiting = wait_for(lambda: (job := get_job(kube, namespace, "dpo"))["status"]["inputs"][0].get("phase") == "Pending"
                       and job, 30, "the input's phase seen")["status"]
    assert waiting["phase"] == "Waiting" and "RLHFJob sft (models.actor) is Pending" in waiting["message"]
    assert waiting["inputs"] == [{"role": "actor", "name": "sft", "uid": sft["metadata"]["uid"], "phase": "Pending"}]
    assert _made(kube, namespace, "dpo") == {}, "a waiting job makes nothing (no RayJob: no Kueue quota either)"

    done = _succeed(kube, namespace, "sft")["status"]
    assert done["outputModel"] == {"claimName": "stages", "subPath": "sft", "final": "final", "kind": "policy",
                                   "step": 3}
    wait_phase(kube, namespace, "dpo", "Pending", "RayJobCreated", timeout=30)
    # The RayJob's creation event may be mirrored into the status (inputs as they were) before the reconcile
    # that made it writes its own: wait for that one.
    wait_for(lambda: get_job(kube, namespace, "dpo")["status"]["inputs"][0]["phase"] == "Succeeded", 30,
             "the inputs the RayJob was made from")
    made = children(kube, namespace, "dpo")
    config = yaml.safe_load(made["ConfigMap"][0]["data"][contract.JOB_CONFIG_FILE])
    actor = config["spec"]["models"]["actor"]
    assert (actor["path"], actor["pvc"], "fromJob" in actor) == ("final", {"claimName": "stages", "subPath": "sft"}, False)
    head = made["RayJob"][0]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volume = next(v["name"] for v in head["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "stages")
    mount = next(m for c in head["containers"] for m in c["volumeMounts"] if m["name"] == volume)
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == (contract.model_mount("actor"), "sft", True)


def test_a_stage_fails_naming_an_input_that_failed_or_went(kube, namespace, operator, kuberay_paused):
    operator.start("--resync-seconds", "3600")
    for stage, first in (("dpo-a", "sft-a"), ("dpo-b", "sft-b")):
        create_job(kube, namespace, rlhf_job(first, checkpoint={"pvc": "stages"}))
        create_job(kube, namespace, _stage(stage, first))
        wait_phase(kube, namespace, first, "Pending", "RayJobCreated")
        wait_phase(kube, namespace, stage, "Waiting", "WaitingForJob")

    RayJobStatus(kube, namespace, names.ray_job("sft-a")).failed("AppFailed", "out of memory")
    failed = wait_phase(kube, namespace, "dpo-a", "Failed", "InputJobFailed", timeout=30)["status"]
    assert "RLHFJob sft-a" in failed["message"] and "out of memory" in failed["message"]

    kube.delete(api.KIND, namespace, "sft-b", get_job(kube, namespace, "sft-b")["metadata"]["uid"])
    gone = wait_phase(kube, namespace, "dpo-b", "Failed", "InputJobDeleted", timeout=30)["status"]
    assert "RLHFJob sft-b" in gone["message"]
    assert _made(kube, namespace, "dpo-a") == _made(kube, namespace, "dpo-b") == {}, "no pod ever started"


def test_an_input_that_cannot_give_the_model_or_a_cycle_fails_the_job(kube, namespace, operator, kuberay_paused):
    operator.start("--resync-seconds", "3600")
    # A reward model as the policy; a policy kept in the input's pods (no checkpoint claim); a cycle.
    create_job(kube, namespace, rlhf_job("rm", algorithm="rm", checkpoint={"pvc": "stages"}, data=PREFERENCES))
    create_job(kube, namespace, _stage("from-rm", "rm"))
    create_job(kube, namespace, rlhf_job("unshared"))
    create_job(kube, namespace, _stage("from-unshared", "unshared"))
    create_job(kube, namespace, _stage("ping", "pong"))
    create_job(kube, namespace, _stage("pong", "ping"))

    for name in ("ping", "pong"):
        cycle = wait_phase(kube, namespace, name, "Failed", "InputCycle", timeout=30)["status"]["message"]
        assert "ping" in cycle and "pong" in cycle
    for name in ("rm", "unshared"):
        wait_phase(kube, namespace, name, "Pending", "RayJobCreated")
        _succeed(kube, namespace, name)
    assert get_job(kube, namespace, "rm")["status"]["outputModel"]["kind"] == "reward"
    mismatch = wait_phase(kube, namespace, "from-rm", "Failed", "InputModelMismatch", timeout=30)["status"]["message"]
    assert "RLHFJob rm exported a reward model, and the actor loads a policy model" in mismatch
    unshared = wait_phase(kube, namespace, "from-unshared", "Failed", "InputHasNoModel", timeout=30)["status"]
    assert "no spec.checkpoint.pvc" in unshared["message"]
    assert "outputModel" not in get_job(kube, namespace, "unshared")["status"]


def test_a_suspended_or_queued_stage_waits_holding_nothing_then_starts_as_such_a_job_starts(
        kube, namespace, operator, kuberay_paused):
    """Waiting composes with suspension and Kueue: while its input runs a stage makes nothing (no RayJob, so
    no Workload and no quota: test_kueue.py shows the quota free for others); once the input Succeeded a
    suspended stage is made Suspended and starts when resumed, a queued one is made for Kueue to admit."""
    operator.start("--resync-seconds", "3600")
    create_job(kube, namespace, rlhf_job("sft", checkpoint={"pvc": "stages"}))
    create_job(kube, namespace, _stage("held", "sft", suspend=True))
    create_job(kube, namespace, _stage("queued", "sft", queueName="team-a"))
    for stage in ("held", "queued"):
        wait_phase(kube, namespace, stage, "Waiting", "WaitingForJob")
    wait_phase(kube, namespace, "sft", "Pending", "RayJobCreated")
    assert _made(kube, namespace, "held") == _made(kube, namespace, "queued") == {}

    _succeed(kube, namespace, "sft")
    wait_phase(kube, namespace, "held", "Suspended", timeout=30)
    queued = wait_for(lambda: kube.get("RayJob", namespace, names.ray_job("queued")), 30, "the queued stage's RayJob")
    assert queued["spec"]["suspend"] is True and queued["metadata"]["labels"][lifecycle.QUEUE_LABEL] == "team-a"
    assert kube.get("RayJob", namespace, names.ray_job("held"))["spec"]["suspend"] is True

    kube.patch(api.KIND, namespace, "held", {"spec": {"suspend": False}})
    wait_for(lambda: kube.get("RayJob", namespace, names.ray_job("held"))["spec"].get("suspend") is False, 30,
             "the resumed stage's RayJob to start")
