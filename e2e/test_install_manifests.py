"""The plain install manifests: rendered from the chart, accepted by a real API server, least privilege."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2e.fixtures import wait_for

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "manifests" / "install.yaml"
OPERATOR = "system:serviceaccount:rlhf-system:rlhf-operator"


def test_install_manifests_are_the_rendered_chart():
    rendered = subprocess.run([str(ROOT / "helm" / "render-manifests.sh")], check=True,
                              capture_output=True, text=True).stdout
    assert rendered == INSTALL.read_text(), "manifests/install.yaml drifted from the chart: run `make manifests`"


@pytest.fixture(scope="module")
def installed(control_plane):
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(INSTALL))
    yield control_plane
    control_plane.kubectl("delete", "--ignore-not-found", "-n", "rlhf-system", "deployment,service,serviceaccount",
                          "-l", "app.kubernetes.io/name=rlhf-operator")
    control_plane.kubectl("delete", "--ignore-not-found", "clusterrole,clusterrolebinding,namespace",
                          "-l", "app.kubernetes.io/name=rlhf-operator")


def can_i(cp, *args: str) -> bool:
    result = cp.kubectl("auth", "can-i", "--as", OPERATOR, *args, check=False)
    return result.stdout.strip() == "yes"


def test_operator_deployment_is_stored_with_a_hardened_pod(installed, kube_api):
    deployment = kube_api.apps.read_namespaced_deployment("rlhf-operator", "rlhf-system")
    pod = deployment.spec.template.spec
    assert pod.service_account_name == "rlhf-operator"
    assert pod.security_context.run_as_non_root is True
    container = pod.containers[0]
    assert container.args[:3] == ["--all-namespaces", "--metrics-port=8080", "--health-port=8081"]
    assert "--leader-elect" in container.args  # replicas elect a leader on a Lease
    assert container.security_context.read_only_root_filesystem is True
    assert container.security_context.capabilities.drop == ["ALL"]


@pytest.mark.parametrize("verb,resource", [
    ("watch", "rlhfjobs.rlhf.dev"), ("patch", "rlhfjobs.rlhf.dev/status"), ("delete", "rlhfjobs.rlhf.dev"),
    ("create", "rayjobs.ray.io"), ("delete", "rayjobs.ray.io"), ("create", "configmaps"),
    ("create", "serviceaccounts"), ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"), ("create", "events"), ("watch", "pods"),
    ("patch", "workloads.kueue.x-k8s.io"),
])
def test_operator_may_do_its_work(installed, verb, resource):
    assert can_i(installed, verb, resource, "-A")


@pytest.mark.parametrize("verb,resource", [
    ("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("delete", "pods"), ("create", "clusterroles"),
    ("delete", "workloads.kueue.x-k8s.io"),
    ("create", "rayclusters.ray.io"), ("delete", "namespaces"),
])
def test_operator_may_do_nothing_else(installed, verb, resource):
    assert not can_i(installed, verb, resource, "-A")


@pytest.mark.parametrize("role, allowed, refused", [
    ("edit", ["create", "delete", "patch", "list"], []),
    ("view", ["get", "list", "watch"], ["create", "delete", "patch"]),
])
def test_users_of_the_built_in_roles_get_rlhfjobs_by_aggregation(installed, namespace, role, allowed, refused):
    """Whoever may edit (or view) a namespace may run (or read) RLHFJobs there, with no extra binding."""
    user = f"{role}-user"
    installed.kubectl("-n", namespace, "create", "rolebinding", user, f"--clusterrole={role}", f"--user={user}")

    def can(verb: str) -> bool:
        return installed.kubectl("auth", "can-i", "--as", user, "-n", namespace, verb, "rlhfjobs.rlhf.dev",
                                 check=False).stdout.strip() == "yes"

    # kube-controller-manager's aggregation controller folds our ClusterRoles into the built-in ones.
    wait_for(lambda: all(can(verb) for verb in allowed), 60, f"{role} to include the RLHFJob rules")
    assert not any(can(verb) for verb in refused)
