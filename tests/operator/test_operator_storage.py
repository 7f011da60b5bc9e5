"""Storage a common cluster has (issue 52): a job of one node on a ReadWriteOnce claim (its head on the worker's
node), and a model cache claim (HF_HOME) on the head and every worker; the claim checks that follow."""

from __future__ import annotations

import pytest
from operator_jobs import as_job, tiny

from rlhf_api import contract
from rlhf_operator import checks, names, render

DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}


def pods(doc: dict) -> tuple[dict, dict]:
    """The head's and the worker's pod spec."""
    cluster = render.ray_job(as_job(doc))["spec"]["rayClusterSpec"]
    [worker] = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"]["template"]["spec"], worker["template"]["spec"]


def on_claims(nodes: int, gpus: int = 8, **resources) -> dict:
    return tiny(checkpoint={"pvc": "ckpt", "path": "/ckpt"},
                resources={"nodes": nodes, "gpusPerNode": gpus, "tolerations": [DEDICATED], **resources})


@pytest.mark.parametrize("gpus", [8, 0])
def test_the_head_of_a_one_node_job_on_a_claim_goes_to_its_worker_s_node_and_tolerates_what_it_does(gpus):
    head, worker = pods(on_claims(1, gpus, **({"gpuProduct": "NVIDIA-H100-80GB-HBM3"} if gpus else {})))
    [term] = head["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # The labels of the worker's pod template, which KubeRay copies onto its pods: the job's worker, no other pod.
    assert term == {"labelSelector": {"matchLabels": names.pod_metadata("tiny", "worker")["labels"]},
                    "topologyKey": "kubernetes.io/hostname"}
    assert head["tolerations"] == worker["tolerations"]
    assert ({"key": "nvidia.com/gpu", "operator": "Exists"} in head["tolerations"]) == bool(gpus)
    assert head.get("affinity", {}).get("nodeAffinity") == worker.get("affinity", {}).get("nodeAffinity")


def test_a_user_s_pod_affinity_is_kept_beside_the_worker_s():
    theirs = {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "topology.kubernetes.io/zone"}
    head, _ = pods(on_claims(1, affinity={"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [theirs]}}))
    required = head["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required[0] == theirs and required[1]["topologyKey"] == "kubernetes.io/hostname"


@pytest.mark.parametrize("doc", [
    on_claims(2),  # several nodes: the claims are shared ones (checks.py), the head stays off the GPU nodes
    tiny(resources={"nodes": 1}),  # no claim: nothing to share
], ids=["two-nodes", "no-claim"])
def test_other_heads_are_placed_as_before(doc):
    head, _ = pods(doc)
    assert "podAffinity" not in head.get("affinity", {})
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} not in head.get("tolerations", [])


@pytest.mark.parametrize("sub_path", ["", "team-a"])
def test_the_model_cache_is_mounted_on_head_and_workers_with_hf_home_there(sub_path):
    head, worker = pods(tiny(resources={"nodes": 2, "modelCache": {"pvc": "hf-cache", "subPath": sub_path}}))
    for pod in (head, worker):
        [container] = pod["containers"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "model-cache"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "model-cache"]
        assert volume["persistentVolumeClaim"] == {"claimName": "hf-cache"}  # shared by jobs: no per-job subPath
        assert mount["mountPath"] == contract.MODEL_CACHE_DIR and "readOnly" not in mount
        assert mount.get("subPath", "") == sub_path
        assert {"name": "HF_HOME", "value": contract.MODEL_CACHE_DIR} in container["env"]


def test_without_a_model_cache_no_pod_sets_hf_home():
    for pod in pods(tiny()):
        assert "HF_HOME" not in {var["name"] for var in pod["containers"][0]["env"]}


def test_a_model_cache_alone_puts_the_head_of_a_one_node_job_beside_its_worker():
    head, _ = pods(tiny(resources={"nodes": 1, "modelCache": {"pvc": "hf-cache"}}))
    assert head["affinity"]["podAffinity"]


# ---------------------------------------------------------------------------------- claim checks


def claims(**modes: list[str]):
    return lambda name: {"spec": {"accessModes": modes[name]}, "status": {"accessModes": modes[name]}} \
        if name in modes else None


def check(doc: dict, **modes: list[str]) -> None:
    checks.check(as_job(doc), lambda name: True, claims(**modes), waited=0)


def with_cache(nodes: int) -> dict:
    return tiny(resources={"nodes": nodes, "modelCache": {"pvc": "cache"}})


def test_one_node_may_use_read_write_once_claims():
    doc = on_claims(1)
    doc["spec"]["models"]["actor"]["pvc"] = {"claimName": "weights"}
    check(doc, ckpt=["ReadWriteOnce"], weights=["ReadWriteOnce"])
    check(with_cache(1), cache=["ReadWriteOnce"])


@pytest.mark.parametrize("doc, claim, field", [
    (on_claims(2), "ckpt", "spec.checkpoint.pvc"),
    (with_cache(2), "cache", "spec.resources.modelCache.pvc"),
], ids=["checkpoint", "model-cache"])
def test_several_nodes_need_a_read_write_many_claim(doc, claim, field):
    with pytest.raises(checks.Unrealisable) as refused:
        check(doc, **{claim: ["ReadWriteOnce"]})
    assert refused.value.reason == "VolumeNotShared"
    assert refused.value.message == (
        f"{field}: claim {claim} is ReadWriteOnce: the head and 2 worker pods mount it on different nodes; "
        "use a ReadWriteMany claim (NFS, CephFS, Filestore, EFS, Lustre...)")


@pytest.mark.parametrize("mode", ["ReadWriteOncePod", "ReadOnlyMany"])
def test_one_node_still_refuses_a_claim_one_pod_mounts_or_none_writes(mode):
    """ReadWriteOncePod: the head and the worker are two pods. ReadOnlyMany: the checkpoints are written."""
    with pytest.raises(checks.Unrealisable) as refused:
        check(on_claims(1), ckpt=[mode])
    assert refused.value.reason == "VolumeNotShared"
    assert refused.value.message == (
        f"spec.checkpoint.pvc: claim ckpt is {mode}: the head and the worker pod both mount it, on the worker's "
        "node; use a ReadWriteMany or ReadWriteOnce claim")
