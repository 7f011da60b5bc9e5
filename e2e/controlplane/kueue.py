"""Kueue's controller manager, its webhooks called by the API server on 127.0.0.1.

A real install puts the webhooks behind a Service and lets Kueue make its own certificates.
Here the API server must call Kueue on loopback, which a Service's endpoints may not hold, so
the webhook configurations of the module's manifests.yaml get a clientConfig.url instead, and
Kueue serves a certificate for 127.0.0.1 signed by the control plane's CA (internal cert
management off). Only the webhooks of Kueue's own API and of the enabled frameworks are
installed: the others (Pods, batch Jobs, Deployments, ...) fail closed, so every other test
would depend on Kueue. stop() removes them first for the same reason.

Kueue's CRDs are installed with the others (crds.py; they are in the etcd seed).
"""

from __future__ import annotations

import base64
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from .binaries import Binaries, cache_dir
from .certs import make_serving_cert
from .client import Api, http_ok
from .errors import ControlPlaneError
from .process import Launcher, free_ports

# Kueue's integrations ("frameworks") in use -> the (API group, resource) their webhooks serve.
FRAMEWORKS = {"ray.io/rayjob": ("ray.io", "rayjobs")}
KUEUE_GROUP = "kueue.x-k8s.io"
WEBHOOKS_API = "/apis/admissionregistration.k8s.io/v1"
WEBHOOK_RESOURCES = {
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
}
NAME_PREFIX = "kueue-"  # as kustomize names them (config/default)
# Added by the ResourceFlavor defaulting webhook: a dry-run create that comes back with it has
# been through Kueue's webhooks.
IN_USE_FINALIZER = "kueue.x-k8s.io/resource-in-use"
# Without internal cert management Kueue v0.19 reads its metrics certificate from this fixed
# path (cmd/kueue/main.go; a mounted Secret in a real install) and exits when it is missing.
# Nothing here verifies the metrics endpoint, so one pair serves every control plane.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def start(launch: Launcher, binaries: Binaries, state_dir: Path, pki: Path, kubeconfig: Path,
          api: Api) -> dict[str, int]:
    """Start Kueue (its CRDs already installed) and register its webhooks; returns the ports
    it took."""
    webhook, metrics, health = free_ports(3)
    ports = {"kueue-webhook": webhook, "kueue-metrics": metrics, "kueue-health": health}
    certs = state_dir / "kueue" / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    make_serving_cert(pki, "kueue-webhook", "kueue-webhook", ["IP:127.0.0.1"])
    shutil.copy(pki / "kueue-webhook.crt", certs / "tls.crt")
    shutil.copy(pki / "kueue-webhook.key", certs / "tls.key")
    _ensure_metrics_cert(certs)
    config = state_dir / "kueue" / "config.yaml"
    config.write_text(yaml.safe_dump(manager_config(webhook, metrics, health, certs)))
    launch.spawn("kueue", [
        str(binaries.kueue),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        "--zap-encoder=console",
    ])
    # Ready: the webhook server listens (Kueue's own readyz check).
    launch.wait(lambda: http_ok(f"http://127.0.0.1:{health}/readyz"), 120, "Kueue /readyz")
    ca = base64.b64encode(api.cafile.read_bytes()).decode()
    for obj in webhook_configurations(binaries.kueue_webhooks, webhook, ca):
        api.request("DELETE", _path(obj, obj["metadata"]["name"]), ok=(200, 404))
        api.request("POST", _path(obj), obj, ok=(201,))
    launch.wait(lambda: _webhooks_answer(api), 60, "Kueue's webhooks through the API server")
    return ports


def remove_webhooks(api: Api, manifests: Path) -> None:
    """Before Kueue stops: a webhook nobody answers refuses what it covers."""
    if api.ready():
        for obj in webhook_configurations(manifests, 0, ""):
            api.request("DELETE", _path(obj, obj["metadata"]["name"]), ok=(200, 404))


def manager_config(webhook: int, metrics: int, health: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2): one replica on loopback ports."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
        "webhook": {"host": "127.0.0.1", "port": webhook, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(FRAMEWORKS)},
        # The visibility API server would listen on a fixed port (8082) with certificates
        # from /visibility; nothing here uses it.
        "featureGates": {"VisibilityOnDemand": False},
    }


def webhook_configurations(manifests: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """The module's webhook configurations, cut to the webhooks in use, each calling
    https://127.0.0.1:<port><its path> and trusting ca_bundle (base64 PEM)."""
    configs = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        webhooks = []
        for hook in doc["webhooks"]:
            if not _in_use(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            webhooks.append({**hook, "clientConfig": {
                "url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}})
        configs.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"],
                        "metadata": {"name": NAME_PREFIX + doc["metadata"]["name"]},
                        "webhooks": webhooks})
    return configs


def _path(obj: dict[str, Any], name: str = "") -> str:
    return "/".join(p for p in (WEBHOOKS_API, WEBHOOK_RESOURCES[obj["kind"]], name) if p)


def _in_use(hook: dict[str, Any]) -> bool:
    """Whether a webhook serves Kueue's own API or a framework in use."""
    served = set(FRAMEWORKS.values())
    return any(group == KUEUE_GROUP or (group, resource) in served
               for rule in hook.get("rules") or []
               for group in rule.get("apiGroups") or []
               for resource in rule.get("resources") or [])


def _webhooks_answer(api: Api) -> bool:
    probe = {"apiVersion": f"{KUEUE_GROUP}/v1beta2", "kind": "ResourceFlavor",
             "metadata": {"name": "rlhf-e2e-webhook-probe"}}
    status, body = api.request("POST", f"/apis/{KUEUE_GROUP}/v1beta2/resourceflavors?dryRun=All",
                               probe, ok=())
    return status == 201 and IN_USE_FINALIZER in (body["metadata"].get("finalizers") or [])


def _ensure_metrics_cert(certs: Path) -> None:
    """A certificate pair in METRICS_CERT_DIR unless there is one (locked: concurrent test
    sessions must not leave a key of one with the certificate of another)."""
    lock_file = cache_dir() / ".kueue-metrics-cert.lock"
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((METRICS_CERT_DIR / f).exists() for f in ("tls.crt", "tls.key")):
            return
        try:
            METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
            for f in ("tls.key", "tls.crt"):
                tmp = METRICS_CERT_DIR / f".{f}.{os.getpid()}"
                shutil.copy(certs / f, tmp)
                tmp.replace(METRICS_CERT_DIR / f)
        except OSError as e:
            raise ControlPlaneError(
                f"Kueue reads its metrics certificate from {METRICS_CERT_DIR} (fixed in Kueue "
                f"v0.19 when it does not manage its own certificates) and it could not be "
                f"written there: {e}") from e
