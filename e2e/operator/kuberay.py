"""The test seam for RayJob status: write it exactly as KubeRay's RayJob controller does.

Under kwok, KubeRay can create a RayJob's cluster and see its pods "Running", but it cannot reach a
Ray dashboard, so a RayJob never gets further on its own. These helpers write the status KubeRay
(ray-operator v1.6, controllers/ray/rayjob_controller.go) writes at each of its transitions, on the
status subresource, so the operator's reaction can be tested step by step:

    New -> Initializing (initRayJobStatusIfNeed) -> Running (job submitted; jobStatus from the
    dashboard) -> Complete / Failed (updateRayJobStatus sets endTime); Running/Initializing ->
    Suspending -> Suspended (cluster fields reset) -> New on resume; Failed -> Retrying -> New.

Tests that drive status this way must not have the real KubeRay operator running at the same
time (it would write its own view); see the `kuberay_paused` fixture.
"""

from __future__ import annotations

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

    def initializing(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Initializing", jobStatus="", jobId=f"{self.name}-x7k2p",
                          rayClusterName=f"{self.name}-abcde", startTime=_now())

    def submitted(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Running", jobStatus="PENDING",
                          dashboardURL=f"{self.name}-head-svc.{self.namespace}.svc.cluster.local:8265")

    def running(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Running", jobStatus="RUNNING",
                          dashboardURL=f"{self.name}-head-svc.{self.namespace}.svc.cluster.local:8265")

    def succeeded(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Complete", jobStatus="SUCCEEDED", reason="",
                          message="Job finished successfully.", endTime=_now(), succeeded=1)

    def failed(self, reason: str, message: str) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Failed", jobStatus="FAILED", reason=reason, message=message,
                          endTime=_now(), failed=1)

    def suspending(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="Suspending")

    def suspended(self) -> dict[str, Any]:
        # KubeRay resets the cluster and Ray job fields once the cluster is gone.
        return self.write(jobDeploymentStatus="Suspended", jobStatus="", rayClusterName="", dashboardURL="",
                          jobId="", reason="", message="")

    def new(self) -> dict[str, Any]:
        return self.write(jobDeploymentStatus="", jobStatus="")
