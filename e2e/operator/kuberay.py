"""The test seam for RayJob status: write it exactly as KubeRay's RayJob controller does.

Under kwok, KubeRay can create a RayJob's cluster and see its pods "Running", but it cannot reach a
Ray dashboard, so a RayJob never gets further on its own. These helpers write the status KubeRay
(ray-operator v1.6, controllers/ray/rayjob_controller.go) writes at each of its transitions, on the
status subresource, so the operator's reaction can be tested step by step:

    New -> Initializing (initRayJobStatusIfNeed) -> Running (job submitted; jobStatus from the
    dashboard) -> Complete / Failed (updateRayJobStatus sets endTime); Running/Initializing ->
    Suspending -> Suspended (cluster fields reset) -> New on resume; Running -> Retrying (a failed
    Ray job with attempts left: `ray_job_failed`) -> New (cluster fields reset, `retried`) ->
    Initializing with a new cluster name and submission id.

Tests that drive status this way must not have the real KubeRay operator running at the same
time (it would write its own view); see the `kuberay_paused` fixture.
"""

from __future__ import annotations

import random
import string
from datetime import datetime, timezone
from typing import Any

from rlhf_operator.kube import Kube


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class RayJobStatus:
    def __init__(self, kube: Kube, namespace: str, name: str):
        self.kube, self.namespace, self.name = kube, namespace, name

    def write(self, **fields: Any) -> dict[str, Any]:
        return self.kube.patch("RayJob", self.namespace, self.name, {"status": fields}, subresource="status")

    def initializing(self, job_suffix: str = "x7k2p", cluster_suffix: str = "abcde") -> dict[str, Any]:
        """The submission id (jobId) and cluster name are the RayJob's name and a suffix KubeRay draws
        at random (`random_suffix`; fixed by default) on every attempt; startTime restarts too."""
        return self.write(jobDeploymentStatus="Initializing", jobStatus="", jobId=f"{self.name}-{job_suffix}",
                          rayClusterName=f"{self.name}-{cluster_suffix}", startTime=_now())

    def submitted(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Running", jobStatus="PENDING",
                          dashboardURL=f"{self.name}-head-svc.{self.namespace}.svc.cluster.local:8265")

    def running(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Running", jobStatus="RUNNING",
                          dashboardURL=f"{self.name}-head-svc.{self.namespace}.svc.cluster.local:8265")

    def succeeded(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Complete", jobStatus="SUCCEEDED", reason="",
                          message="Job finished successfully.", endTime=_now(), succeeded=1)

    def failed(self, reason: str, message: str, count: int = 1) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Failed", jobStatus="FAILED", reason=reason, message=message,
                          endTime=_now(), failed=count)

    def ray_job_failed(self, message: str) -> dict[str, Any]:
        """The Ray job ended FAILED (AppFailed), with KubeRay's retry rule.

        checkBackoffLimitAndUpdateStatusIfNeeded counts the attempt in status.failed and, while
        failed < backoffLimit + 1, turns Failed into Retrying before the status is written: an attempt
        that will be retried is never stored as Failed and gets no endTime.
        """
        ray_job = self.kube.get("RayJob", self.namespace, self.name)
        count = ((ray_job.get("status") or {}).get("failed") or 0) + 1
        if count >= ray_job["spec"].get("backoffLimit", 0) + 1:
            return self.failed("AppFailed", message, count)
        return self.write(jobDeploymentStatus="Retrying", jobStatus="FAILED", reason="AppFailed", message=message,
                          failed=count)

    def suspending(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Suspending")

    def _released(self, deployment: str) -> dict[str, Any]:
        # KubeRay resets the cluster and Ray job fields once the cluster is gone (Suspending and Retrying alike).
        return self.write(jobDeploymentStatus=deployment, jobStatus="", rayClusterName="", dashboardURL="",
                          jobId="", reason="", message="")

    def suspended(self) -> dict[str, Any]:
        return self._released("Suspended")

    def new(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="", jobStatus="")


def random_suffix() -> str:
    """What KubeRay's GenerateRayJobId and GenerateRayClusterName append to the RayJob's name."""
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
