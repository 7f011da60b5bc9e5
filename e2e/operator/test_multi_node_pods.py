"""What the pods of a multi-node job need from the operator, on the real API server.

A job's claims are mounted by its head and every worker pod, on different nodes. A claim only one
node at a time can attach (ReadWriteOnce, ReadWriteOncePod) left the pods in Multi-Attach errors and
the job Provisioning forever: the operator now refuses it, saying what to use, before it creates the
RayJob (the claims are `local` volumes, e2e/storage.py, bound by the real PV controller). A job of one
node may use a ReadWriteOnce claim: its head is placed on its worker's node, here by the real scheduler
on a tainted kwok GPU node. And the pods real KubeRay makes from the RayJob run as
the image's user, own their volumes by its group, and only the head, where the driver runs, holds an
API token.
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
GPU_NODES = ("kwok-gpu-h100-0", "kwok-gpu-a100-0")  # e2e/kwok/nodes.yaml


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


def test_claims_the_job_s_pods_cannot_share_fail_it_before_its_ray_job(kube, kube_api, namespace, operator, tmp_path):
    """ReadWriteOncePod for a job of one node: its head and worker are two pods. ReadWriteOnce for a model cache
    of several nodes: every pod downloads into it."""
    local_claim(kube_api.core, namespace, "one-pod", tmp_path / "one-pod", access_modes=("ReadWriteOncePod",))
    local_claim(kube_api.core, namespace, "one-node", tmp_path / "one-node", access_modes=("ReadWriteOnce",))
    operator.start()
    create_job(kube, namespace, rlhf_job("rwop", checkpoint={"pvc": "one-pod", "path": "/checkpoints"},
                                         resources={"nodes": 1}))
    create_job(kube, namespace, rlhf_job("cache", resources={"nodes": WORKERS, "modelCache": {"pvc": "one-node"}}))
    for name, says in [("rwop", "spec.checkpoint.pvc: claim one-pod is ReadWriteOncePod: the head and the worker pod"),
                       ("cache", f"spec.resources.modelCache.pvc: claim one-node is ReadWriteOnce: the head and "
                                 f"{WORKERS} worker pods")]:
        status = wait_phase(kube, namespace, name, "Failed", "VolumeNotShared")["status"]
        assert status["message"].startswith(says), status["message"]
        assert kube.get("RayJob", namespace, names.ray_job(name)) is None


def test_a_one_node_job_on_read_write_once_claims_runs_its_head_on_its_worker_s_node(
        kube, kube_api, namespace, kuberay_operator, operator, tmp_path):
    """The volumes stand for zonal disks that either of kwok's GPU nodes can attach: the scheduler puts the
    worker on one of them, and the head, which requests no GPU, beside it on that tainted node."""
    for claim in ("checkpoints", "weights", "hf-cache"):
        local_claim(kube_api.core, namespace, claim, tmp_path / claim, access_modes=("ReadWriteOnce",), node=GPU_NODES)
    operator.start()
    job = rlhf_job("one-node", checkpoint={"pvc": "checkpoints", "path": "/checkpoints"},
                   resources={"nodes": 1, "gpusPerNode": 1, "modelCache": {"pvc": "hf-cache"}})
    job["spec"]["models"]["actor"]["pvc"] = {"claimName": "weights"}
    create_job(kube, namespace, job)
    placed = {role: wait_for(lambda r=role: next((p for p in pods(kube, namespace, "one-node", r)
                                                  if p["spec"].get("nodeName")), None), 120, f"the {role} pod placed")
              for role in ("worker", "head")}
    assert placed["worker"]["spec"]["nodeName"] in GPU_NODES
    assert placed["head"]["spec"]["nodeName"] == placed["worker"]["spec"]["nodeName"]
    assert get_job(kube, namespace, "one-node").get("status", {}).get("phase") != "Failed"


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
