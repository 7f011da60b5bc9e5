"""The KubeRay operator (its CRDs are installed with the others, see crds.py).

It runs in a mount namespace of its own whose /etc/hosts is the control plane's hosts file: there is
no cluster DNS here, and the pod runtime (e2e/pods) writes the head Services' names into that file,
so KubeRay reaches a head's dashboard at the URL it builds (<svc>.<ns>.svc.cluster.local:8265).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .client import http_ok
from .process import free_ports

if TYPE_CHECKING:
    from .cluster import ControlPlane


def start(cp: ControlPlane) -> None:
    metrics, probe = free_ports(2)
    cp.ports["kuberay-metrics"], cp.ports["kuberay-probe"] = metrics, probe
    if not cp.hosts_file.exists():
        cp.hosts_file.write_text(Path("/etc/hosts").read_text())
    cp._spawn("kuberay-operator", [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
        str(cp.hosts_file), str(cp.binaries.kuberay_operator),
        f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ])
    cp._wait(lambda: http_ok(f"http://127.0.0.1:{probe}/readyz"), 60,
             "KubeRay operator /readyz")
