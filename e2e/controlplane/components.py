"""kube-controller-manager and kube-scheduler: both are launched right after the API server
and waited for after the CRDs are in, so that their start overlaps the CRD install."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .apiserver import SERVICE_CIDR
from .client import http_ok

if TYPE_CHECKING:
    from .cluster import ControlPlane


def _flags(cp: ControlPlane, name: str) -> list[str]:
    """What both take: the admin kubeconfig, and a loopback serving port of their own."""
    return [
        f"--kubeconfig={cp.kubeconfig}",
        f"--authentication-kubeconfig={cp.kubeconfig}",
        f"--authorization-kubeconfig={cp.kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={cp.ports[name]}",
        f"--cert-dir={cp.state_dir / 'certs' / name}",
        "--leader-elect=false",
    ]


def launch_controller_manager(cp: ControlPlane) -> None:
    pki = cp.pki
    cp._spawn("kube-controller-manager", [
        str(cp.binaries.kube_controller_manager),
        *_flags(cp, "kube-controller-manager"),
        # Signs legacy ServiceAccount token Secrets; the serviceaccount controller makes
        # each namespace's "default" account, the GC deletes orphaned dependents.
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--use-service-account-credentials=false",
        "--controllers=*",
        "--v=1",
    ])


def wait_controller_manager(cp: ControlPlane) -> None:
    port = cp.ports["kube-controller-manager"]
    cp._wait(lambda: http_ok(f"https://127.0.0.1:{port}/healthz"), 60,
             "kube-controller-manager /healthz")
    # The serviceaccount controller is running once "default" has its account.
    cp._wait(lambda: cp._get_json(
        "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200, 60,
        "ServiceAccount default/default (serviceaccount controller)")


def launch_scheduler(cp: ControlPlane) -> None:
    cp._spawn("kube-scheduler", [
        str(cp.binaries.kube_scheduler), *_flags(cp, "kube-scheduler"), "--v=1"])


def wait_scheduler(cp: ControlPlane) -> None:
    port = cp.ports["kube-scheduler"]
    cp._wait(lambda: http_ok(f"https://127.0.0.1:{port}/readyz"), 60,
             "kube-scheduler /readyz")
