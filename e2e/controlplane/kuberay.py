"""The KubeRay operator (its CRDs are installed with the others, see crds.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .client import http_ok
from .process import free_ports

if TYPE_CHECKING:
    from .cluster import ControlPlane


def start(cp: ControlPlane) -> None:
    metrics, probe = free_ports(2)
    cp.ports["kuberay-metrics"], cp.ports["kuberay-probe"] = metrics, probe
    cp._spawn("kuberay-operator", [
        str(cp.binaries.kuberay_operator),
        f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ])
    cp._wait(lambda: http_ok(f"http://127.0.0.1:{probe}/readyz"), 60,
             "KubeRay operator /readyz")
