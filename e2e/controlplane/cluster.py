"""ControlPlane: the facade that starts, stops and attaches to a whole control plane.

Each component lives in its own module (etcd, apiserver, components, kwok, kuberay, kueue), a
function of plain inputs: its binary, paths and ports, a process.Launcher (starts and records
processes, waits on them) and a client.Api (the API server as an admin). None of them imports
this module; ControlPlane composes them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from . import apiserver, components, crds, etcd, kuberay, kueue, kwok, policies, seed
from .binaries import BUILD_TARGETS, Binaries, cache_dir, find_kubectl
from .certs import make_pki, write_admin_token
from .client import Api
from .errors import ControlPlaneError
from .process import Launcher, Process, free_ports, prune, tail
from .state import load_state, save_state

# What stop_component/start_component can restart (data dir and ports kept).
RESTARTABLE = ("etcd", "kube-apiserver")
# Run dirs kept after failed sessions (under <cache>/e2e-runs), newest first.
RUNS_KEPT = 8
# The dev cluster's kubelet (`python -m e2e.pods`), started beside the control plane by e2e/pods/devcluster.py.
POD_RUNTIME = "pod-runtime"
# Order of stopping: dependents first; the pod runtime stops its pods through the API server, each within
# its grace period (30 s by default), so it gets longer than SIGTERM's usual 10 s.
STOP_ORDER = (
    POD_RUNTIME,
    "kueue",
    "kuberay-operator",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)


class ControlPlane:
    """etcd + kube-apiserver, plus optional controller-manager, scheduler, kwok, KubeRay and
    Kueue.

    state_dir holds certificates, the kubeconfig, etcd's data, one log per process and
    state.json (ports, PIDs, timings). A temporary one is made when none is given.
    apiserver_flags go to kube-apiserver after its own (an API switched off: apiserver.start).
    """

    def __init__(
        self,
        state_dir: Path | str | None = None,
        *,
        controller_manager: bool = True,
        scheduler: bool = True,
        kwok: bool = False,
        kuberay: bool = False,
        kueue: bool = False,
        crds: bool = True,
        crd_paths: Iterable[Path] | None = None,
        build: bool = True,
        seed: bool | None = None,
        die_with_parent: bool = True,
        log: Callable[[str], None] | None = None,
        binaries: Binaries | None = None,
        apiserver_flags: Sequence[str] = (),
    ) -> None:
        self._own_state_dir = state_dir is None
        if state_dir is None:
            runs = cache_dir() / "e2e-runs"
            runs.mkdir(parents=True, exist_ok=True)
            prune(runs, keep=RUNS_KEPT)
            state_dir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs)
        self.state_dir = Path(state_dir).resolve()
        self.want_controller_manager = controller_manager
        self.want_scheduler = scheduler
        self.want_kwok = kwok
        self.want_kuberay = kuberay
        self.want_kueue = kueue
        self.want_crds = crds
        self.extra_crd_paths = list(crd_paths or [])
        self.build = build
        # Start etcd from a cached copy that already holds the CRDs (see seed.py).
        self.use_seed = (os.environ.get("RLHF_E2E_NO_SEED") != "1") if seed is None else seed
        self.seeded_from: Path | None = None
        self.crd_names: list[str] = []
        self.die_with_parent = die_with_parent
        self.log = log or (lambda msg: print(f"[controlplane] {msg}", file=sys.stderr, flush=True))
        self.binaries = binaries or Binaries.default()
        self.apiserver_flags = list(apiserver_flags)
        self.versions = self.binaries.versions
        self.processes: dict[str, Process] = {}
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.token = ""
        self.fake_nodes: list[str] = []
        # CRD file -> the API server's refusal, for the repo's own CRDs (see install_all_crds).
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
    def hosts_file(self) -> Path:
        """KubeRay's /etc/hosts (see kuberay.py): the cluster DNS names the pod runtime writes, on this machine's."""
        return self.state_dir / "hosts"

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def api(self) -> Api:
        """The API server as the admin (raw JSON requests, see client.py)."""
        return Api(self.server, self.token, self.pki / "ca.crt")

    @property
    def launcher(self) -> Launcher:
        """Starts this control plane's processes (logs in logs_dir, recorded in processes and
        state.json) and waits on them (failing fast when one has died)."""
        return Launcher(self.logs_dir, self.state_dir, self.env(), self.die_with_parent,
                        self.processes, self._save_state)

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
            etcd_seed = None
            if self.want_crds and self.use_seed:
                t = time.monotonic()
                key = seed.seed_key(self.versions, [
                    *self.kuberay_crd_files(), *self.kueue_crd_files(), *self.repo_crd_files()])
                etcd_seed = seed.etcd_seed(key, self._make_seed, self.log)
                self.timings["etcd-seed"] = round(time.monotonic() - t, 2)
            self.seeded_from = etcd_seed
            self._phase("etcd", lambda: self._start_etcd(etcd_seed))
            self._phase("kube-apiserver", self._start_apiserver)
            # Launched now, waited for after the CRDs: their start overlaps the CRD install.
            kubeconfig, state_dir, pki, ports = self.kubeconfig, self.state_dir, self.pki, self.ports
            if self.want_controller_manager:
                components.launch_controller_manager(
                    self.launcher, self.binaries.kube_controller_manager, kubeconfig, state_dir,
                    ports["kube-controller-manager"], pki)
            if self.want_scheduler:
                components.launch_scheduler(self.launcher, self.binaries.kube_scheduler,
                                            kubeconfig, state_dir, ports["kube-scheduler"])
            if self.want_crds:
                self._phase("crds", lambda: self._crds_from_seed(etcd_seed) if etcd_seed
                            else self.install_all_crds())
                self._phase("policies", lambda: policies.install(self.kubectl))
                self._phase("admission", lambda: crds.wait_admission_ready(self.launcher, self.api, self.crd_names))
            if self.want_controller_manager:
                self._phase("kube-controller-manager", lambda: components.wait_controller_manager(
                    self.launcher, ports["kube-controller-manager"], self.api))
            if self.want_scheduler:
                self._phase("kube-scheduler", lambda: components.wait_scheduler(
                    self.launcher, ports["kube-scheduler"]))
            if self.want_kwok:
                self.start_kwok()
            if self.want_kuberay:
                self.start_kuberay()
            if self.want_kueue:
                self.start_kueue()
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
            self.processes[name].stop(60.0 if name == POD_RUNTIME else 10.0)
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

    # ----------------------------------------------------------------- faults
    def stop_component(self, name: str) -> None:
        """Stop etcd or kube-apiserver (the others keep running, as when that one crashes)."""
        if name not in RESTARTABLE:
            raise ControlPlaneError(f"cannot restart {name!r}, only {', '.join(RESTARTABLE)}")
        self.processes.pop(name).stop()
        self._save_state()

    def start_component(self, name: str) -> None:
        """Start a stopped etcd or kube-apiserver again on the same ports and data dir; return
        once the API server answers /readyz (which needs etcd too) and admits the CRDs' kinds again."""
        {"etcd": self._start_etcd, "kube-apiserver": self._start_apiserver}[name]()
        self.launcher.wait(self.api.ready, apiserver.READY_TIMEOUT, "kube-apiserver /readyz")
        crds.wait_admission_ready(self.launcher, self.api, self.crd_names)
        if "kube-controller-manager" in self.processes:
            components.wait_controllers_watching(self.launcher, self.api)

    # ----------------------------------------------------------------- optional parts
    def _start_optional(self, name: str, target: str, start: Callable[[], None]) -> None:
        """Start process `name` once (build target first): start(), timed, saved."""
        if name in self.processes:
            return
        t0 = time.monotonic()
        if self.build:
            self.binaries.ensure([target], self.log)
        start()
        self.timings[name] = round(time.monotonic() - t0, 2)
        self._save_state()

    def start_kwok(self) -> list[str]:
        """Start kwok and create the fake nodes of e2e/kwok/nodes.yaml; wait until Ready."""
        def start() -> None:
            self.fake_nodes = kwok.start(self.launcher, self.binaries, self.state_dir,
                                         self.kubeconfig, self.api)

        self._start_optional("kwok", "kwok", start)
        self.want_kwok = True
        return self.fake_nodes

    def start_kuberay(self) -> None:
        """Start the KubeRay operator (its CRDs are installed by install_all_crds)."""
        self._start_optional("kuberay-operator", "kuberay", lambda: self.ports.update(
            kuberay.start(self.launcher, self.binaries.kuberay_operator, self.hosts_file)))
        self.want_kuberay = True

    def start_kueue(self) -> None:
        """Start Kueue's controller manager and its webhooks (see kueue.py); wait until they
        answer through the API server."""
        def start() -> None:
            if not any(name.endswith(f".{kueue.KUEUE_GROUP}") for name in self.crd_names):
                self.crd_names += self.install_crds(self.kueue_crd_files())  # no CRDs yet
            self.ports.update(kueue.start(self.launcher, self.binaries, self.state_dir, self.pki,
                                          self.kubeconfig, self.api))

        self._start_optional("kueue", "kueue", start)
        self.want_kueue = True

    def stop_kueue(self) -> None:
        """Remove Kueue's webhooks (they fail closed), then stop it: the cluster is as before."""
        proc = self.processes.pop("kueue", None)
        if proc is not None:
            kueue.remove_webhooks(self.api, self.binaries.kueue_webhooks)
            proc.stop()
        self.want_kueue = False
        self._save_state()

    # ----------------------------------------------------------------- CRDs (crds.py)
    def repo_crd_files(self) -> list[Path]:
        """Every YAML in the repo's crds/ plus any extra paths given."""
        return crds.repo_crd_files(self.extra_crd_paths)

    def kuberay_crd_files(self) -> list[Path]:
        return crds.kuberay_crd_files(self.binaries)

    def kueue_crd_files(self) -> list[Path]:
        return crds.kueue_crd_files(self.binaries)

    def install_all_crds(self) -> None:
        """KubeRay's and Kueue's CRDs (must apply) and the repo's crds/; a refused repo CRD
        goes to crd_errors instead of failing the start."""
        names, errors = crds.install_all(
            self.install_crds, [*self.kuberay_crd_files(), *self.kueue_crd_files()],
            self.repo_crd_files(), self.log)
        self.crd_names += names
        self.crd_errors.update(errors)

    def install_crds(self, files: Sequence[Path]) -> list[str]:
        """Server-side apply CRD files; wait until Established. Returns the CRD names."""
        return crds.install(self.kubectl, self.launcher, self.api, files)

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
        write_admin_token(self.pki, self.token)
        make_pki(self.pki)

    def _start_etcd(self, seed: Path | None = None) -> None:
        etcd.start(self.launcher, self.binaries.etcd, self.state_dir / "etcd",
                   self.ports["etcd-client"], self.ports["etcd-peer"], seed)

    def _start_apiserver(self) -> None:
        apiserver.start(self.launcher, self.binaries.kube_apiserver, self.state_dir, self.pki,
                        self.ports["kube-apiserver"], self.ports["etcd-client"], self.api,
                        self.kubeconfig, self.apiserver_flags)

    def _crds_from_seed(self, etcd_seed: Path) -> None:
        """Take the CRD names and refusals recorded in the seed; wait until they are Established."""
        names, errors = seed.crds_from_seed(etcd_seed)
        self.crd_names = names
        self.crd_errors.update(errors)
        for f, err in self.crd_errors.items():
            self.log(f"CRD {f} was refused by the API server:\n{err}")
        crds.wait_established(self.launcher, self.api, self.crd_names)

    def _make_seed(self, run_dir: Path) -> tuple[list[str], dict[str, str]]:
        """Install the CRDs in a control plane of its own in run_dir (see seed.etcd_seed)."""
        seeder = type(self)(
            run_dir, controller_manager=False, scheduler=False, kwok=False, kuberay=False,
            kueue=False, crds=True, build=False, seed=False, crd_paths=self.extra_crd_paths,
            die_with_parent=self.die_with_parent, log=self.log, binaries=self.binaries)
        seeder.start()  # stops the seeder itself when it fails
        seeder.stop(keep_state=True)  # graceful stop: etcd's files are consistent
        return seeder.crd_names, seeder.crd_errors

    # ----------------------------------------------------------------- state file
    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _save_state(self) -> None:
        save_state(self.state_file, server=self.server if "kube-apiserver" in self.ports else None,
                   kubeconfig=self.kubeconfig, ports=self.ports, versions=self.versions,
                   timings=self.timings, fake_nodes=self.fake_nodes, processes=self.processes)

    @classmethod
    def attach(cls, state_dir: Path | str) -> ControlPlane:
        """A handle on a control plane started by another process (e.g. `up`)."""
        cp = cls(state_dir, build=False, die_with_parent=False)
        cp._own_state_dir = False
        state = load_state(cp.state_file, cp.kubeconfig)
        cp.ports, cp.timings, cp.fake_nodes = state["ports"], state["timings"], state["fake_nodes"]
        cp.processes, cp.token = state["processes"], state["token"]
        return cp

    def healthy(self) -> bool:
        return (all(p.alive() for p in self.processes.values())
                and "kube-apiserver" in self.ports
                and self.api.ready())
