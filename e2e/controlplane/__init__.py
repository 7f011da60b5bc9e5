"""A real Kubernetes control plane on loopback, for tests and local use.

etcd + kube-apiserver (RBAC, service-account signing keys, an admin token), and on request
kube-controller-manager, kube-scheduler, kwok (fake GPU and CPU nodes, see e2e/kwok/), the
KubeRay operator and Kueue (its webhooks called on 127.0.0.1). The binaries are built from
upstream Go modules by e2e/build/build.sh at the versions pinned in e2e/build/versions.env.
Every process listens on free loopback ports, logs to its own file in the state directory and
is stopped by PID. The CRDs (crds/, KubeRay's and Kueue's) are installed once per set of CRD
files into a cached etcd "seed" that later starts copy.

As a library::

    with ControlPlane(kwok=True, kuberay=True, kueue=True) as cp:
        ...  # cp.kubeconfig, cp.env(), cp.api_client()

As a developer command (leaves the control plane running in the background)::

    python -m e2e.controlplane up        # prints: export KUBECONFIG=...
    python -m e2e.controlplane status
    python -m e2e.controlplane down
"""

# (The docstring above is also the --help text of the command.)
#
# Layout, by concern:
#   binaries.py    versions.env, the cache dir, Binaries (built by build.sh), find_kubectl
#   process.py     Process (stop by PID), spawn, wait_until, Launcher, free_ports, tail, prune
#   certs.py       the PKI (openssl) and the admin token file
#   client.py      the raw HTTPS client of the API server (Api), health checks
#   etcd.py, apiserver.py, components.py (kube-controller-manager, kube-scheduler),
#   kwok.py, kuberay.py, kueue.py
#                  one module per component: functions of plain inputs (binary, paths, ports,
#                  an Api) that launch the process with a Launcher, wait until it is ready
#                  and return what they made (ports, node names)
#   queues.py      Kueue ResourceFlavors/ClusterQueue/LocalQueue over the kwok nodes
#   crds.py        CRD install and the wait for Established
#   seed.py        the cached etcd data dirs that already hold the CRDs
#   state.py       state.json: what `attach` reads
#   cluster.py     ControlPlane, the facade composing all of the above; only this file and
#                  cli.py import it (e2e/test_control_plane.py checks)
#   cli.py         `python -m e2e.controlplane up|down|status|env` (__main__.py)
#
# Adding a component: its module (like kuberay.py: free_ports, launch.spawn, launch.wait), its
# binary in Binaries (and build.sh/BUILD_TARGETS), its place in cluster.STOP_ORDER, and on
# ControlPlane a constructor flag plus a start_<name>() built on _start_optional.

from .apiserver import CLUSTER_NAME, SA_ISSUER, SERVICE_CIDR
from .binaries import (
    BUILD_SH,
    BUILD_TARGETS,
    E2E,
    REPO,
    VERSIONS_FILE,
    Binaries,
    cache_dir,
    find_kubectl,
    read_versions,
)
from .certs import ADMIN_USER
from .cluster import RUNS_KEPT, STOP_ORDER, ControlPlane
from .crds import CRDS_DIR, FIELD_MANAGER
from .errors import ControlPlaneError
from .kwok import KWOK_DIR
from .process import Process, free_ports, tail

__all__ = [
    "ADMIN_USER", "BUILD_SH", "BUILD_TARGETS", "CLUSTER_NAME", "CRDS_DIR", "E2E",
    "FIELD_MANAGER", "KWOK_DIR", "REPO", "RUNS_KEPT", "SA_ISSUER", "SERVICE_CIDR",
    "STOP_ORDER", "VERSIONS_FILE", "Binaries", "ControlPlane", "ControlPlaneError",
    "Process", "cache_dir", "find_kubectl", "free_ports", "read_versions", "tail",
]
