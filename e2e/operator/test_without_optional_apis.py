"""A cluster without the optional APIs (docs/compatibility.md): an API server that serves no
MutatingAdmissionPolicy (as before Kubernetes 1.36: the API and its feature gate switched off), and Kueue's
CRDs served at v1beta1 only (as before Kueue 0.15).

- The chart installs there without its algorithm-defaults policy (Helm asks the API server), and the operator
  does the policy's part: the trainer's config carries the algorithm's defaults, and a job that only the
  defaults make invalid fails with InvalidSpec instead of being refused at admission.
- The operator discovers Kueue's v1beta1 and reads and patches a queued job's Workload there. Kueue 0.19's
  controller speaks only v1beta2, so the Workload is written by the test as Kueue would (no controller runs);
  the RayJob's status is written as KubeRay would (e2e/operator/kuberay.py).

One control plane of its own for the module (etcd and the API server, no seed: its CRDs differ).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.controlplane import ControlPlane
from e2e.controlplane.binaries import built
from e2e.controlplane.crds import wait_established
from e2e.fixtures import wait_for
from e2e.operator.conftest import OperatorProcess, stop_operator
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import contract
from rlhf_api.v1alpha1 import KIND
from rlhf_operator import kueue, names
from rlhf_operator.kube import Kube

pytestmark = pytest.mark.needs_build  # a control plane of its own, and helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rlhf-operator"
MAP = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"
NO_MUTATING_POLICIES = [
    "--feature-gates=MutatingAdmissionPolicy=false",
    "--runtime-config=admissionregistration.k8s.io/v1/mutatingadmissionpolicies=false,"
    "admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings=false",
]
NAMESPACE = "older-cluster"
KUEUE_MESSAGE = "couldn't assign flavors to pod set head: insufficient unused quota for cpu in flavor default"


def served_at_v1beta1_only(crd_files: list[Path], out: Path) -> list[Path]:
    """Kueue's CRDs as an older Kueue serves them: v1beta1 alone, and stored at it (Kueue 0.19's serve both)."""
    written = []
    for path in crd_files:
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            version["served"] = version["storage"] = version["name"] == "v1beta1"
        written.append(out / path.name)
        written[-1].write_text(yaml.safe_dump(crd))
    return written


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Any:
    binary, home = built("helm", "HELM"), tmp_path_factory.mktemp("helm-home")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str) -> str:
        return subprocess.run([binary, *args], check=True, capture_output=True, text=True, env=env).stdout

    return run


@pytest.fixture(scope="module")
def older_cluster(request, helm, tmp_path_factory) -> Iterator[ControlPlane]:
    cp = ControlPlane(controller_manager=False, scheduler=False, crds=False, apiserver_flags=NO_MUTATING_POLICIES)
    cp.start()
    try:
        # The kinds the operator reads and writes, of KubeRay and of Kueue (as an older Kueue serves it).
        (ray_jobs,) = [f for f in cp.kuberay_crd_files() if f.name == "ray.io_rayjobs.yaml"]
        (workloads,) = [f for f in cp.kueue_crd_files() if f.name == f"{kueue.GROUP}_workloads.yaml"]
        cp.install_crds([ray_jobs, *served_at_v1beta1_only([workloads], tmp_path_factory.mktemp("kueue-crds"))])
        helm("install", "rlhf", str(CHART), "-n", "rlhf-system", "--create-namespace",
             "--kubeconfig", str(cp.kubeconfig))
        wait_established(cp.launcher, cp.api, ["rlhfjobs.rlhf.dev"])  # the chart's own
        cp.kubectl("create", "namespace", NAMESPACE)
        yield cp
    finally:
        cp.stop(keep_state=request.session.testsfailed > 0)


@pytest.fixture(scope="module")
def kube(older_cluster: ControlPlane, tmp_path_factory) -> Iterator[Kube]:
    """The operator's client, with the operator running on the older cluster."""
    kube = Kube(older_cluster.api_client())
    process = OperatorProcess(older_cluster, NAMESPACE, tmp_path_factory.mktemp("operator")).start()
    try:
        yield kube
    finally:
        stop_operator(kube, NAMESPACE, process)
        kube.api_client.close()


def online_job(name: str, algorithm: str, **spec: Any) -> dict[str, Any]:
    return rlhf_job(name, algorithm=algorithm, data={"prompts": {"sources": [{"path": "org/prompts"}]}},
                    reward={"sources": [{"name": "check", "type": "function", "function": {"entrypoint": "rewards:score"}}]},
                    rollout={"samplesPerPrompt": 4}, **spec)


def test_the_chart_renders_the_policy_only_where_it_is_served(older_cluster, helm):
    policies = [doc["kind"] for doc in yaml.safe_load_all(helm("get", "manifest", "rlhf", "-n", "rlhf-system",
                                                               "--kubeconfig", str(older_cluster.kubeconfig))) if doc]
    assert "ValidatingAdmissionPolicy" in policies and "MutatingAdmissionPolicy" not in policies
    served = helm("template", "rlhf", str(CHART), "--api-versions", MAP)
    assert "kind: MutatingAdmissionPolicy\n" in served and "kind: MutatingAdmissionPolicyBinding\n" in served


def test_the_operator_fills_in_the_algorithm_defaults(kube):
    create_job(kube, NAMESPACE, online_job("drgrpo", "dr-grpo"))
    assert "lossAggregation" not in (get_job(kube, NAMESPACE, "drgrpo")["spec"].get("training") or {})  # stored as sent
    config_map = wait_for(lambda: kube.get("ConfigMap", NAMESPACE, names.config_map("drgrpo")), 60, "the job's ConfigMap")
    training = yaml.safe_load(config_map["data"][contract.JOB_CONFIG_FILE])["spec"]["training"]
    assert (training["lossAggregation"], training["clipEps"], training["clipEpsHigh"]) == ("seq-mean-token-sum-norm", 0.2, 0.0)

    # gspo's clipEps default (3e-4) is above this clipEpsHigh: the policy's cluster refuses the job at admission.
    create_job(kube, NAMESPACE, online_job("gspo", "gspo", training={"clipEpsHigh": 0.0002}))
    failed = wait_phase(kube, NAMESPACE, "gspo", "Failed", "InvalidSpec")
    assert "clipEpsHigh must be 0 (same as clipEps) or at least clipEps" in failed["status"]["message"]


def workload_v1beta1(ray_job: dict[str, Any]) -> dict[str, Any]:
    """The Workload an older Kueue makes for a queued RayJob, not yet admitted."""
    return {
        "apiVersion": f"{kueue.GROUP}/v1beta1", "kind": "Workload",
        "metadata": {"name": f"rayjob-{ray_job['metadata']['name']}", "namespace": NAMESPACE,
                     "labels": {kueue.JOB_UID_LABEL: ray_job["metadata"]["uid"]}},
        "spec": {"queueName": "team", "podSets": [{"name": "head", "count": 1, "template": {
            "spec": {"containers": [{"name": "ray-head", "image": "trainer"}]}}}]},
    }


def test_a_queued_job_uses_kueue_s_v1beta1_workload(kube):
    assert kueue.served_version(kube) == "v1beta1"
    create_job(kube, NAMESPACE, rlhf_job("queued", queueName="team"))
    ray_job = wait_for(lambda: kube.get("RayJob", NAMESPACE, names.ray_job("queued")), 60, "the RayJob")
    workloads = client.CustomObjectsApi(kube.api_client)
    created = workloads.create_namespaced_custom_object(kueue.GROUP, "v1beta1", NAMESPACE, kueue.PLURAL,
                                                        workload_v1beta1(ray_job))
    workloads.patch_namespaced_custom_object_status(
        kueue.GROUP, "v1beta1", NAMESPACE, kueue.PLURAL, created["metadata"]["name"], {"status": {"conditions": [
            {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": KUEUE_MESSAGE,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, _content_type="application/merge-patch+json")
    RayJobStatus(kube, NAMESPACE, ray_job["metadata"]["name"]).suspended()
    queued = wait_phase(kube, NAMESPACE, "queued", "Suspended", "Queued")
    assert KUEUE_MESSAGE in queued["status"]["message"]

    def active() -> bool:
        return kueue.active(kueue.workload(kube, ray_job))

    kube.patch(KIND, NAMESPACE, "queued", {"spec": {"suspend": True}})
    wait_for(lambda: not active(), 60, "the v1beta1 Workload deactivated")
    kube.patch(KIND, NAMESPACE, "queued", {"spec": {"suspend": False}})
    wait_for(active, 60, "the v1beta1 Workload active again")
