"""kube-controller-manager and kube-scheduler: both are launched right after the API server
and waited for after the CRDs are in, so that their start overlaps the CRD install."""

from __future__ import annotations

import secrets
from pathlib import Path

from .apiserver import SERVICE_CIDR
from .client import Api, http_ok
from .process import Launcher, Process


def _flags(name: str, kubeconfig: Path, state_dir: Path, port: int) -> list[str]:
    """What both take: the admin kubeconfig, and a loopback serving port of their own."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={state_dir / 'certs' / name}",
        "--leader-elect=false",
    ]


def launch_controller_manager(launch: Launcher, binary: Path, kubeconfig: Path, state_dir: Path,
                              port: int, pki: Path) -> Process:
    return launch.spawn("kube-controller-manager", [
        str(binary),
        *_flags("kube-controller-manager", kubeconfig, state_dir, port),
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


def wait_controller_manager(launch: Launcher, port: int, api: Api) -> None:
    launch.wait(lambda: http_ok(f"https://127.0.0.1:{port}/healthz"), 60,
                "kube-controller-manager /healthz")
    # The serviceaccount controller is running once "default" has its account.
    launch.wait(lambda: api.get_json(
        "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200, 60,
        "ServiceAccount default/default (serviceaccount controller)")


def wait_controllers_watching(launch: Launcher, api: Api) -> None:
    """After an API server restart, until the controller manager's informers watch again: a new
    namespace gets its default ServiceAccount. They come back after client-go's reflector backoff,
    which grows with each failed attempt while the server is down (up to 30 s), so the tests after
    a restart would otherwise race it."""
    name = f"restart-probe-{secrets.token_hex(3)}"
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}}, ok=(201,))
    launch.wait(lambda: api.get_json(f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200,
                120, f"ServiceAccount {name}/default (controller manager watching again)")
    api.request("DELETE", f"/api/v1/namespaces/{name}", ok=(200, 202))


def launch_scheduler(launch: Launcher, binary: Path, kubeconfig: Path, state_dir: Path,
                     port: int) -> Process:
    return launch.spawn("kube-scheduler", [
        str(binary), *_flags("kube-scheduler", kubeconfig, state_dir, port), "--v=1"])


def wait_scheduler(launch: Launcher, port: int) -> None:
    launch.wait(lambda: http_ok(f"https://127.0.0.1:{port}/readyz"), 60,
                "kube-scheduler /readyz")
