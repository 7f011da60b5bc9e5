"""The KubeRay operator (its CRDs are installed with the others, see crds.py).

It runs in a mount namespace of its own whose /etc/hosts is the control plane's hosts file: there is
no cluster DNS here, and the pod runtime (e2e/pods) writes the head Services' names into that file,
so KubeRay reaches a head's dashboard at the URL it builds (<svc>.<ns>.svc.cluster.local:8265).
"""

from __future__ import annotations

from pathlib import Path
from .client import http_ok
from .process import Launcher, free_ports


def start(launch: Launcher, binary: Path, hosts_file: Path) -> dict[str, int]:
    """Start the operator with hosts_file (made from this machine's if missing) as its
    /etc/hosts; returns the ports it took."""
    metrics, probe = free_ports(2)
    ports = {"kuberay-metrics": metrics, "kuberay-probe": probe}
    if not hosts_file.exists():
        hosts_file.write_text(Path("/etc/hosts").read_text())
    launch.spawn("kuberay-operator", [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
        str(hosts_file), str(binary),
        f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
    ])
    launch.wait(lambda: http_ok(f"http://127.0.0.1:{probe}/readyz"), 60,
                "KubeRay operator /readyz")
    return ports
