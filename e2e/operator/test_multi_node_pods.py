"""What the pods of a multi-node job need from the operator, on the real API server.

A job's claims are mounted by its head and every worker pod, on different nodes. A claim only one
node at a time can attach (ReadWriteOnce, ReadWriteOncePod) left the pods in Multi-Attach errors and
the job Provisioning forever: the operator now refuses it, saying what to use, before it creates the
RayJob (the claims are `local` volumes, e2e/storage.py, bound by the real PV controller). And the
pods real KubeRay makes from the RayJob run as the image's user, own their volumes by its group,
and only the head, where the driver runs, holds an API token.
"""

from __future__ import annotations

import pytest

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from e2e.operator.test_security import ROLES, pods
from e2e.storage import local_claim
from rlhf_api import contract
from rlhf_operator import names

WORKERS = 2


def job_on_claims(name: str, checkpoint: str, model: str | None = None) -> dict:
    job = rlhf_job(name, checkpoint={"pvc": checkpoint, "path": f"/checkpoints/{name}"},
                   resources={"nodes": WORKERS})
    if model:
        job["spec"]["models"]["actor"]["pvc"] = {"claimName": model}
    return job


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_a_checkpoint_claim_one_node_at_a_time_fails_the_job_before_its_ray_job(
        kube, kube_api, namespace, operator, tmp_path, mode):
    local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "volume", access_modes=(mode,))
    operator.start()
    create_job(kube, namespace, job_on_claims("one-node", "checkpoints"))
    status = wait_phase(kube, namespace, "one-node", "Failed", "VolumeNotShared")["status"]
    assert status["message"] == (
        f"spec.checkpoint.pvc: claim checkpoints is {mode}: the head and {WORKERS} worker pods mount it on "
        "different nodes; use a ReadWriteMany claim (NFS, CephFS, Filestore, EFS, Lustre...)")
    assert kube.get("RayJob", namespace, names.ray_job("one-node")) is None


def test_a_model_claim_one_node_at_a_time_fails_the_job(kube, kube_api, namespace, operator, tmp_path):
    local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints")
    local_claim(kube_api.core, namespace, "weights", tmp_path / "weights", access_modes=("ReadWriteOnce",))
    operator.start()
    create_job(kube, namespace, job_on_claims("model-rwo", "checkpoints", model="weights"))
    status = wait_phase(kube, namespace, "model-rwo", "Failed", "VolumeNotShared")["status"]
    assert status["message"].startswith("spec.models.actor.pvc: claim weights is ReadWriteOnce:")
    assert "use a ReadWriteMany or ReadOnlyMany claim" in status["message"]


def test_claims_every_pod_can_mount_get_their_ray_job(kube, kube_api, namespace, operator, tmp_path):
    local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints")
    local_claim(kube_api.core, namespace, "weights", tmp_path / "weights", access_modes=("ReadOnlyMany",))
    operator.start()
    create_job(kube, namespace, job_on_claims("shared", "checkpoints", model="weights"))
    wait_for(lambda: kube.get("RayJob", namespace, names.ray_job("shared")), 60, "the RayJob")
    assert get_job(kube, namespace, "shared").get("status", {}).get("phase") != "Failed"


def test_kuberay_s_pods_run_as_the_image_user_and_only_the_head_holds_a_token(
        kube, namespace, kuberay_operator, operator):
    operator.start()
    create_job(kube, namespace, rlhf_job("pods"))
    # KubeRay creates the head and the worker; once kwok reports them running, the submitter Job's pod.
    made = {role: wait_for(lambda r=role: pods(kube, namespace, "pods", r), 180, f"the {role} pod")[0]["spec"]
            for role in ROLES}
    for role, pod in made.items():
        security = pod["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (contract.TRAINER_UID,) * 3, role
        assert security["fsGroupChangePolicy"] == "OnRootMismatch" and security["runAsNonRoot"] is True, role
        tokens = [v for v in pod.get("volumes", []) if v["name"].startswith("kube-api-access-")]
        assert bool(tokens) == (role == "head"), (role, pod.get("volumes"))
    assert made["head"]["serviceAccountName"] == names.trainer("pods")
    assert made["worker"]["automountServiceAccountToken"] is False
