"""A failed run's Ray cluster kept for debugging (spec.keepFailedCluster), with the real KubeRay: the
RayJob's deletionRules (KubeRay's RayJobDeletionPolicy feature gate, beta and on by default since
v1.6, not switched off by the test world's KubeRay start) keep the RayCluster of a failed RayJob
for the seconds asked, or until the RLHFJob is deleted.

The runs fail at startup, which is quick and needs no Ray: their pods ask for a node no node has, and
startupDeadlineSeconds (KubeRay's preRunningDeadlineSeconds) fails the RayJob. The deadline leaves KubeRay
time to create the cluster first (it counts from a start time truncated to the second: at 1 s, a busy
KubeRay failed a RayJob before creating its cluster, and there was nothing to keep).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from rlhf_api import v1alpha1 as api
from rlhf_operator import lifecycle, names
from rlhf_operator.kube import Kube

NOWHERE = {"e2e.rlhf.dev/no-such-node": "true"}
TIMEOUT = 120  # KubeRay, kwok and the operator share two busy cores
KEEP_SECONDS = 5
STARTUP_DEADLINE = 20  # seconds


def failing_job(name: str, **spec: Any) -> dict[str, Any]:
    return rlhf_job(name, startupDeadlineSeconds=STARTUP_DEADLINE, resources={"nodeSelector": NOWHERE}, **spec)


def ray_cluster(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    found = kube._request("GET", f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters",
                          query=[("fieldSelector", f"metadata.name={name}")])["items"]
    return found[0] if found else None


def test_a_failed_run_keeps_its_cluster_as_long_as_asked(kube, namespace, kuberay_operator, operator):
    operator.start()
    jobs = {"dropped": None, "kept": {}, "kept-a-while": {"seconds": KEEP_SECONDS}}
    for name, keep in jobs.items():
        create_job(kube, namespace, failing_job(name, **({} if keep is None else {"keepFailedCluster": keep})))
    for name in jobs:  # each run has its cluster before its deadline fails it
        wait_for(lambda: ray_cluster(kube, namespace, (kube.get("RayJob", namespace, names.ray_job(name)) or {})
                                     .get("status", {}).get("rayClusterName", "-")), TIMEOUT, f"{name}'s RayCluster")
    failed = {name: wait_phase(kube, namespace, name, "Failed", "PreRunningDeadlineExceeded", TIMEOUT)["status"]
              for name in jobs}
    clusters = {name: status["rayClusterName"] for name, status in failed.items()}

    # Without keepFailedCluster, KubeRay deletes the cluster as the run ends (shutdownAfterJobFinishes).
    wait_for(lambda: ray_cluster(kube, namespace, clusters["dropped"]) is None, TIMEOUT, "the dropped cluster to go")
    assert "keptCluster" not in failed["dropped"]

    # Kept for KEEP_SECONDS after the RayJob's end, as the status says; then KubeRay deletes it.
    ended = kube.get("RayJob", namespace, names.ray_job("kept-a-while"))["status"]["endTime"]
    until = lifecycle.timestamp(lifecycle.parse(ended) + timedelta(seconds=KEEP_SECONDS))
    assert failed["kept-a-while"]["keptCluster"] == {"name": clusters["kept-a-while"], "until": until}
    assert f"is kept for debugging until {until}" in failed["kept-a-while"]["message"]
    wait_for(lambda: ray_cluster(kube, namespace, clusters["kept-a-while"]) is None, TIMEOUT,
             f"KubeRay to delete the cluster kept until {until}")

    # Kept until the RLHFJob goes: still there after the others went, and deleted with the job.
    assert failed["kept"]["keptCluster"] == {"name": clusters["kept"]}
    assert "is kept for debugging until the RLHFJob is deleted" in failed["kept"]["message"]
    assert ray_cluster(kube, namespace, clusters["kept"]) is not None
    kube.delete(api.KIND, namespace, "kept", get_job(kube, namespace, "kept")["metadata"]["uid"])
    wait_for(lambda: ray_cluster(kube, namespace, clusters["kept"]) is None, TIMEOUT,
             "the kept cluster to go with its RLHFJob")


def test_a_job_that_keeps_its_cluster_can_be_suspended_and_resumed(kube, namespace, kuberay_operator, operator):
    """KubeRay refuses to suspend a RayJob without shutdownAfterJobFinishes (ValidationFailed, final), which
    deletionRules exclude: the operator switches back to it in the patch that suspends."""
    operator.start()
    create_job(kube, namespace, rlhf_job("paused", keepFailedCluster={}, resources={"nodeSelector": NOWHERE}))
    wait_for(lambda: (kube.get("RayJob", namespace, names.ray_job("paused")) or {}).get("status", {}).get(
        "rayClusterName"), TIMEOUT, "KubeRay to start the cluster")
    kube.patch(api.KIND, namespace, "paused", {"spec": {"suspend": True}})
    wait_phase(kube, namespace, "paused", "Suspended", "Suspended", TIMEOUT)
    assert "deletionStrategy" not in kube.get("RayJob", namespace, names.ray_job("paused"))["spec"]

    kube.patch(api.KIND, namespace, "paused", {"spec": {"suspend": False}})
    try:
        wait_for(lambda: kube.get("RayJob", namespace, names.ray_job("paused"))["status"].get("jobDeploymentStatus")
                 == "Initializing", TIMEOUT, "KubeRay to start the resumed job's cluster")
    except AssertionError as timeout:  # once in a loaded whole run (passes alone in 19 s): say where KubeRay was
        ray_job = kube.get("RayJob", namespace, names.ray_job("paused"))
        raise AssertionError(f"{timeout}; the RayJob's spec.suspend {ray_job['spec'].get('suspend')}, "
                             f"status {ray_job.get('status')}") from None
    resumed = kube.get("RayJob", namespace, names.ray_job("paused"))["spec"]
    assert resumed["deletionStrategy"]["deletionRules"] and not resumed.get("shutdownAfterJobFinishes")
    # The job's phase follows the RayJob's status at the operator's next event: waited for, not read at once
    # (a loaded whole run read Suspended here, before the operator had mirrored KubeRay's Initializing).
    wait_for(lambda: get_job(kube, namespace, "paused")["status"]["phase"] in ("Pending", "Provisioning"), TIMEOUT,
             "the resumed job's phase to leave Suspended")
