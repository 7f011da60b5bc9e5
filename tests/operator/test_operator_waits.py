"""What a starting or queued job waits for, read from KubeRay, the scheduler, the kubelet and Kueue."""

from __future__ import annotations

from rlhf_operator import kueue, pods


def pod(name: str, conditions=(), containers=()) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": list(conditions), "containerStatuses": list(containers)}}


def test_the_scheduler_s_reason_comes_first_by_pod_name():
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": '0/3 nodes are available: persistentvolumeclaim "rlhf-checkpoints" not found.'}
    pulling = {"name": "ray-worker", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}
    found = [pod("job-worker-0", containers=[pulling]), pod("job-head", conditions=[unschedulable])]
    assert pods.pod_problem(found) == ("Unschedulable", f"pod job-head: {unschedulable['message']}")
    assert pods.pod_problem(found[:1]) == ("ImagePullBackOff", "pod job-worker-0, container ray-worker: not found")


def test_pods_that_are_only_starting_are_no_problem():
    creating = {"name": "ray-head", "state": {"waiting": {"reason": "ContainerCreating"}}}
    scheduled = {"type": "PodScheduled", "status": "True"}
    assert pods.pod_problem([pod("job-head", conditions=[scheduled], containers=[creating])]) is None


def test_kuberay_replica_failure_is_read_from_the_ray_job():
    ray_job = {"status": {"rayClusterStatus": {"conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateHeadPod",
         "message": 'pods "x" is forbidden: exceeded quota'}]}}}
    assert pods.cluster_problem(ray_job) == ("FailedCreateHeadPod", 'KubeRay: pods "x" is forbidden: exceeded quota')
    assert pods.cluster_problem({"status": {}}) is None


def test_the_workload_follows_spec_suspend():
    admitted = {"spec": {"active": True}}
    assert kueue.active_patch(admitted, suspend=True) == {"spec": {"active": False}}
    assert kueue.active_patch(admitted, suspend=False) is None
    assert kueue.active_patch({"spec": {}}, suspend=False) is None  # active defaults to true
    assert kueue.active_patch({"spec": {"active": False}}, suspend=False) == {"spec": {"active": True}}


def test_kueue_s_reason_for_not_admitting():
    pending = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                          "message": "insufficient quota for nvidia.com/gpu in flavor h100"}]}}
    assert kueue.waiting_reason(pending) == ("Pending", "insufficient quota for nvidia.com/gpu in flavor h100")
    assert kueue.waiting_reason({"status": {"conditions": [{"type": "QuotaReserved", "status": "True"}]}}) is None
    assert kueue.waiting_reason(None) is None
