"""The chart's RBAC is exactly what the operator uses, proven with the API server's audit log.

The operator runs under the chart's ServiceAccount, with only the chart's (Cluster)Roles bound, for
a whole lifecycle on the real control plane with KubeRay and Kueue (a queued job admitted,
suspended, resumed, deleted; a job failed by its deadline and deleted by its TTL). Then, from the
audit log of that ServiceAccount's requests: nothing was forbidden except what kopf is known to
try and do without, and every (group, resource, verb) the chart grants was used. Twice: the cluster
install (a ClusterRole) and the namespaced install (watchNamespaces: Roles only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e.controlplane import apiserver
from e2e.fixtures import wait_for
from e2e.operator.conftest import OperatorProcess, stop_operator
from e2e.operator.jobs import create_job, rlhf_job, wait_gone, wait_phase
from e2e.operator.test_kueue import GPUS_PER_JOB, H100, TIMEOUT, gpu_job, wait_admitted, workload
from e2e.test_helm_chart import CHART, helm, values_file  # noqa: F401  (helm is a fixture)
from rlhf_api import v1alpha1 as api
from rlhf_operator import kueue
from rlhf_operator.lifecycle import now, seconds_until_deadline
from rlhf_operator.kube import Kube

NAMESPACE = apiserver.AUDITED_NAMESPACE  # the operator's release namespace: its requests are audited
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")
USER_ROLES = ("rlhfjob-editor", "rlhfjob-viewer")  # for people, not the operator
# kopf tries these when it watches only some namespaces and carries on without them (it then
# learns of new CRDs and namespaces at restart only).
TOLERATED_DENIALS = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
AUTHORIZATION = "authorization.k8s.io/decision"  # the authorizer's verdict on a request, in its audit event


def install_rbac(helm, control_plane, tmp_path: Path, release: str, values: dict) -> list[dict]:
    """Apply the chart's ServiceAccount and RBAC objects (not the Deployment: the test runs the operator)."""
    rendered = helm("template", release, str(CHART), "-f", values_file(tmp_path, values), "--namespace", NAMESPACE,
                    "--set", "userRoles.aggregate=false").stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in RBAC_KINDS
            and not d["metadata"]["name"].endswith(USER_ROLES)]
    control_plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    return docs


def token_kubeconfig(control_plane, service_account: str, path: Path, namespace: str = NAMESPACE) -> Path:
    """A kubeconfig that authenticates with a token of the ServiceAccount (a real TokenRequest)."""
    token = control_plane.kubectl("create", "token", service_account, "-n", namespace, "--duration", "2h").stdout
    config = yaml.safe_load(control_plane.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token.strip()}
    path.write_text(yaml.safe_dump(config))
    return path


def granted(docs: list[dict]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for doc in docs if doc["kind"] in ("ClusterRole", "Role")
            for rule in doc["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def audited(control_plane, service_account: str) -> list[dict]:
    user = f"system:serviceaccount:{NAMESPACE}:{service_account}"
    lines = apiserver.audit_log(control_plane.state_dir).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["user"]["username"] == user and "objectRef" in e]


def request_key(event: dict) -> tuple[str, str, str]:
    ref = event["objectRef"]
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return ref.get("apiGroup", ""), resource, event["verb"]


def lifecycle(kube: Kube, namespace: str, queue: str) -> None:
    """Every path that needs a permission: a claim read, children made, a Kueue Workload and a RayJob suspended,
    status mirrored, a RayJob deleted out of band recreated (its children exist: created, refused
    as existing, read to check their owner), a deadline failing a job and its TTL deleting it, a
    deletion finalized."""
    create_job(kube, namespace, gpu_job("queued", queue))
    wait_admitted(kube, namespace, "queued")
    wait_phase(kube, namespace, "queued", "Provisioning", timeout=TIMEOUT)
    kube.patch(api.KIND, namespace, "queued", {"spec": {"suspend": True}})
    wait_for(lambda: not kueue.active(workload(kube, namespace, "queued")), TIMEOUT, "the Workload deactivated")
    wait_phase(kube, namespace, "queued", "Suspended", "Suspended", timeout=TIMEOUT)
    kube.patch(api.KIND, namespace, "queued", {"spec": {"suspend": False}})
    wait_admitted(kube, namespace, "queued")

    # Not queued: the operator suspends its RayJob itself. Its checkpoint claim is read (access modes), and its
    # runtime by name (the queued job's lookup of a default listed them).
    kube.create({"apiVersion": api.API_VERSION, "kind": "ClusterRLHFRuntime", "metadata": {"name": namespace},
                 "spec": {"resources": {"shmSize": "2Gi"}}})
    create_job(kube, namespace, rlhf_job("plain", checkpoint={"pvc": "rlhf-checkpoints"},
                                         runtimeRef={"name": namespace}))
    wait_phase(kube, namespace, "plain", "Provisioning", timeout=TIMEOUT)
    deleted = kube.get("RayJob", namespace, "plain")["metadata"]["uid"]
    kube.delete("RayJob", namespace, "plain", deleted)
    wait_for(lambda: (kube.get("RayJob", namespace, "plain") or {"metadata": {"uid": deleted}})["metadata"]["uid"]
             != deleted, TIMEOUT, "the RayJob recreated")
    kube.patch(api.KIND, namespace, "plain", {"spec": {"suspend": True}})
    wait_phase(kube, namespace, "plain", "Suspended", "Suspended", timeout=TIMEOUT)

    kube.create({"apiVersion": api.API_VERSION, "kind": "RLHFRuntime", "metadata": {"name": "team", "namespace": namespace},
                 "spec": {"resources": {"nodeSelector": {"rlhf.dev/nowhere": "true"}}}})
    create_job(kube, namespace, rlhf_job("short", activeDeadlineSeconds=3600, ttlSecondsAfterFinished=1,
                                         runtimeRef={"kind": "RLHFRuntime", "name": "team"}))
    # Shortened once it has run for a second: the operator's deadline has passed and the RayJob's
    # (KubeRay's, still 3600 s) has not, so the operator fails the job and deletes the RayJob itself
    # (with 1 s from the start, KubeRay's own deadline sometimes ended the attempt first).
    wait_for(lambda: (seconds_until_deadline({"activeDeadlineSeconds": 1}, kube.get(api.KIND, namespace, "short")
                                             .get("status"), now()) or 1) < 0, TIMEOUT, "the job to start")
    kube.patch(api.KIND, namespace, "short", {"spec": {"activeDeadlineSeconds": 1}})
    wait_gone(kube, api.KIND, namespace, "short", timeout=TIMEOUT)
    queued = kube.get(api.KIND, namespace, "queued")
    kube.delete(api.KIND, namespace, "queued", queued["metadata"]["uid"])
    wait_gone(kube, api.KIND, namespace, "queued", timeout=TIMEOUT)


@pytest.fixture
def audited_namespace(control_plane):
    control_plane.kubectl("create", "namespace", NAMESPACE, check=False)
    return NAMESPACE


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_the_chart_grants_exactly_what_a_lifecycle_uses(helm, control_plane, kube, namespace, kueue_queues,
                                                         audited_namespace, tmp_path, scope):
    release = f"rbac-{scope}"
    values = {"watchNamespaces": [namespace]} if scope == "namespaced" else {}
    docs = install_rbac(helm, control_plane, tmp_path, release, values)
    # cluster-wide either way: reading cluster runtimes (a cluster-scoped kind)
    assert any(d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("-runtimes")
               for d in docs) == (scope == "cluster")

    operator = OperatorProcess(control_plane, namespace if scope == "namespaced" else None, tmp_path,
                               kubeconfig=token_kubeconfig(control_plane, release, tmp_path / "kubeconfig"))
    try:
        operator.start("--leader-elect", "--leader-elect-resource-namespace", NAMESPACE,
                       "--leader-elect-resource-name", release)
        lifecycle(kube, namespace, kueue_queues({H100: GPUS_PER_JOB}))
    finally:
        stop_operator(kube, namespace, operator)
        if runtime := kube.get("ClusterRLHFRuntime", "", namespace):
            kube.delete("ClusterRLHFRuntime", "", namespace, runtime["metadata"]["uid"])

    events = audited(control_plane, release)
    assert events, "no audited request: is the operator running as the chart's ServiceAccount?"
    # Refused by RBAC, not by admission: a 403 for a namespace being terminated (another test's, which the
    # cluster-wide operator also watches) was authorized.
    denied = {request_key(e)[:2] for e in events if e.get("annotations", {}).get(AUTHORIZATION) == "forbid"}
    assert denied <= (TOLERATED_DENIALS if scope == "namespaced" else set()), (
        f"the chart does not grant what the operator needs: {sorted(denied)}\n{operator.logs()}")
    used = {request_key(e) for e in events if e.get("annotations", {}).get(AUTHORIZATION) == "allow"}
    unused = granted(docs) - used
    assert not unused, f"the chart grants what the operator never used: {sorted(unused)}"
