"""With the real KubeRay operator and the real scheduler on kwok GPU nodes: the Ray cluster's pods
land on the matching GPU node with the resources, env, volumes and security context we asked for.
"""

from __future__ import annotations

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, rlhf_job, wait_phase

H100_NODE, CPU_NODE = "kwok-gpu-h100-0", "kwok-cpu-0"


def pods(kube, namespace: str, node_type: str) -> list[dict]:
    return kube._request("GET", f"/api/v1/namespaces/{namespace}/pods",
                         query=[("labelSelector", f"rlhf.dev/job=train,ray.io/node-type={node_type}")])["items"]


def scheduled(kube, namespace: str, node_type: str) -> dict | None:
    found = [p for p in pods(kube, namespace, node_type) if p["spec"].get("nodeName")]
    return found[0] if found else None


def env_of(container: dict) -> dict:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container.get("env", [])}


def test_ray_cluster_pods_run_on_the_matching_gpu_nodes(kube, namespace, kuberay_operator, operator):
    operator.start()
    job = rlhf_job("train", resources={
        "gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3", "shmSize": "8Gi",
        "worker": {"cpu": "16", "memory": "64Gi"},
        "rdma": {"resourceName": "rdma/rdma_shared_device_a", "hca": "mlx5_0", "gidIndex": 3},
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    })
    create_job(kube, namespace, job)

    head = wait_for(lambda: scheduled(kube, namespace, "head"), 120, "the head pod to be scheduled")
    worker = wait_for(lambda: scheduled(kube, namespace, "worker"), 120, "the worker pod to be scheduled")
    assert head["spec"]["nodeName"] == CPU_NODE  # untainted CPU node: the head tolerates no GPU taint
    assert head["spec"]["serviceAccountName"] == "train-trainer"
    assert worker["spec"]["nodeName"] == H100_NODE

    [head_container] = [c for c in head["spec"]["containers"] if c["name"] == "ray-head"]
    assert head_container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in head_container["ports"]
    assert env_of(head_container)["RLHF_JOB_NAME"] == "train"
    assert env_of(head_container)["RLHF_METRICS_PORT"] == "9400"

    [worker_container] = [c for c in worker["spec"]["containers"] if c["name"] == "ray-worker"]
    limits = worker_container["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["rdma/rdma_shared_device_a"], limits["cpu"]) == ("8", "1", "16")
    worker_env = env_of(worker_container)
    assert (worker_env["NCCL_IB_HCA"], worker_env["NCCL_IB_GID_INDEX"]) == ("mlx5_0", "3")
    assert worker_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert worker_container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert worker_container["securityContext"]["allowPrivilegeEscalation"] is False

    volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in worker_container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes[mounts["/etc/rlhf/job.yaml"]["name"]]["configMap"]["name"] == "train-config"

    # KubeRay found the cluster ready and its dashboard through the head Service, and submitted the
    # job; under kwok no Ray answers, so this is as far as a real run gets here.
    status = wait_phase(kube, namespace, "train", "Provisioning", "SubmittingJob", timeout=120)["status"]
    assert status["rayClusterName"].startswith("train-")
    assert status["dashboardURL"].endswith(":8265")
