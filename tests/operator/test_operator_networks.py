"""The networks of a GPU cluster (issue 52, item 3): pod labels and annotations (a Multus attachment), RoCE's
adapters, GID index and traffic class, and the workers on the host network; as the operator renders them.
Admission of these fields: tests/test_api.py."""

from __future__ import annotations

from operator_jobs import as_job, tiny

from rlhf_api import contract
from rlhf_operator import names, render

MULTUS = "k8s.v1.cni.cncf.io/networks"


def pods(spec: dict | None = None, **resources) -> tuple[dict, dict]:
    """The head's and the worker's pod templates of a GPU job with these resources (and other spec fields)."""
    doc = tiny(**(spec or {}), resources={"gpusPerNode": 8, **resources})
    cluster = render.ray_job(as_job(doc))["spec"]["rayClusterSpec"]
    [worker] = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"]["template"], worker["template"]


def container(pod: dict) -> dict:
    [only] = pod["spec"]["containers"]
    return only


def env(pod: dict) -> dict:
    return {var["name"]: var.get("value") for var in container(pod)["env"]}


def test_labels_and_annotations_reach_the_head_and_workers_the_network_the_workers_only():
    head, worker = pods(podLabels={"example.com/team": "llm"}, podAnnotations={"example.com/owner": "ana"},
                        worker={"podAnnotations": {MULTUS: "roce-net"}})
    for pod, role in ((head, "head"), (worker, "worker")):
        assert pod["metadata"]["labels"] == {"example.com/team": "llm", **names.pod_metadata("tiny", role)["labels"]}
        assert pod["metadata"]["annotations"]["example.com/owner"] == "ana"
        assert pod["metadata"]["annotations"][names.JOB_ANNOTATION] == "tiny"
    assert worker["metadata"]["annotations"][MULTUS] == "roce-net"
    assert MULTUS not in head["metadata"]["annotations"]


def test_a_worker_annotation_wins_over_the_pods_one():
    _, worker = pods(podAnnotations={MULTUS: "tcp-net"}, worker={"podAnnotations": {MULTUS: "roce-net"}})
    assert worker["metadata"]["annotations"][MULTUS] == "roce-net"


def test_the_keys_admission_reserves_are_those_the_operator_sets():
    """contract.OPERATOR_POD_* is what admission refuses in podLabels and podAnnotations: it must name every
    key the operator puts on a Ray pod, or a user's would silently lose to it."""
    _, worker = pods({"queueName": "team-a"}, topology={"level": "cloud.example.com/rack"})
    metadata = names.pod_metadata("tiny", "worker")
    assert set(metadata["labels"]) == set(contract.OPERATOR_POD_LABELS)
    assert {*metadata["annotations"], *render.TOPOLOGY_ANNOTATIONS.values()} == set(contract.OPERATOR_POD_ANNOTATIONS)
    assert set(worker["metadata"]["annotations"]) <= set(contract.OPERATOR_POD_ANNOTATIONS)


def test_roce_adapters_gid_index_and_traffic_class_are_nccl_s_settings():
    _, worker = pods(rdma={"hca": "=mlx5_0:1,mlx5_1:1", "gidIndex": 3, "trafficClass": 106})
    assert {key: env(worker)[key] for key in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TC")} == {
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "3", "NCCL_IB_TC": "106"}
    _, default = pods(rdma={})
    assert "NCCL_IB_TC" not in env(default) and "NCCL_IB_GID_INDEX" not in env(default)


def test_host_network_puts_the_workers_on_it_holding_ray_s_ports_and_leaves_the_head():
    head, worker = pods(hostNetwork=True)
    assert (worker["spec"]["hostNetwork"], worker["spec"]["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    ports = {port["containerPort"]: port.get("hostPort") for port in container(worker)["ports"]}
    assert ports == {render.RAY_METRICS_PORT: render.RAY_METRICS_PORT,
                     render.RAY_DASHBOARD_AGENT_PORT: render.RAY_DASHBOARD_AGENT_PORT}
    assert "hostNetwork" not in head["spec"] and "dnsPolicy" not in head["spec"]
    _, plain = pods()
    assert "hostNetwork" not in plain["spec"] and "ports" not in container(plain)
