"""kube-apiserver: RBAC, the PKI of certs.py, service-account tokens, an audit log; writes the kubeconfig."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
import yaml

from .certs import ADMIN_USER
from .client import Api
from .process import Launcher, Process

CLUSTER_NAME = "rlhf-e2e"
SERVICE_CIDR = "10.96.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# A bound on /readyz after a start or a restart, not an expectation (a few seconds on a quiet machine): a restart
# during a cold suite's peak (the control plane's own Go build beside the tests, load 18 on 2 cores) took over
# 120 s, etcd's client retrying all along.
READY_TIMEOUT = 300
# The service accounts of this namespace are audited (request metadata in <state>/audit.log), so
# that a test can compare what a component really does with the RBAC rules it is granted.
AUDITED_NAMESPACE = "rlhf-audit"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": [f"system:serviceaccounts:{AUDITED_NAMESPACE}"]},
              {"level": "None"}],
}


def start(launch: Launcher, binary: Path, state_dir: Path, pki: Path, port: int, etcd_port: int,
          api: Api, kubeconfig: Path, extra_flags: Sequence[str] = ()) -> Process:
    """Start the API server on port, over etcd on etcd_port; once api answers /readyz,
    write the admin kubeconfig. extra_flags: e.g. --runtime-config or --feature-gates, for a cluster
    without an API the default one serves."""
    policy = state_dir / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    proc = launch.spawn("kube-apiserver", [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        # The "kubernetes" Service's endpoints may not be a loopback address, and nothing
        # here runs in a real pod network: do not reconcile them.
        "--endpoint-reconciler-type=none",
        f"--secure-port={port}",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        # pods/log reads: the kubelet reached by its node's IP (as kubeadm sets it), its certificate checked.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        "--authorization-mode=Node,RBAC",
        "--anonymous-auth=true",  # /livez, /readyz, /version stay reachable
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--api-audiences={SA_ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        "--enable-admission-plugins=NodeRestriction",
        # Admission webhooks (the chart's) called at their Service's endpoints, the pods' IPs: no kube-proxy
        # routes a ClusterIP here.
        "--enable-aggregator-routing=true",
        "--profiling=false",
        "--event-ttl=1h",
        f"--audit-policy-file={policy}",
        f"--audit-log-path={audit_log(state_dir)}",
        "--v=1",
        *extra_flags,
    ])
    launch.wait(api.ready, READY_TIMEOUT, "kube-apiserver /readyz")
    write_kubeconfig(kubeconfig, api)
    return proc


def audit_log(state_dir: Path) -> Path:
    return state_dir / "audit.log"


def write_kubeconfig(kubeconfig: Path, api: Api) -> None:
    ca = base64.b64encode(api.cafile.read_bytes()).decode()
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CLUSTER_NAME, "cluster": {
            "server": api.server, "certificate-authority-data": ca}}],
        "users": [{"name": ADMIN_USER, "user": {"token": api.token}}],
        "contexts": [{"name": CLUSTER_NAME, "context": {
            "cluster": CLUSTER_NAME, "user": ADMIN_USER, "namespace": "default"}}],
        "current-context": CLUSTER_NAME,
    }
    tmp = kubeconfig.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(kubeconfig)
