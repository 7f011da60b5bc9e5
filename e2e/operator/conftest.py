"""Fixtures for the operator's end-to-end tests on the real control plane.

- `operator`: `rlhf operator --namespace <the test's namespace>` as a subprocess (stopped by PID);
  it can be killed and restarted, and started with RLHF_OPERATOR_CRASH_AFTER.
- `kuberay_paused`: no KubeRay operator while the test drives RayJob status itself (e2e/operator/kuberay.py).
- `kube`: the operator's own dict-based client, on the control plane.

Helpers to make jobs and look at their children are in e2e/operator/jobs.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from e2e.controlplane import ControlPlane, free_ports
from e2e.fixtures import answers, wait_for
from e2e.operator.inprocess import event_poster, operator_client, trainer  # noqa: F401 - fixtures of in-process tests
from rlhf_api import v1alpha1 as api
from rlhf_operator.kube import Kube

REPO = Path(__file__).resolve().parents[2]
PORT_ATTEMPTS = 3


class OperatorProcess:
    """One `rlhf operator` process at a time, watching one namespace; logs to a file per start."""

    def __init__(self, control_plane: ControlPlane, namespace: str | None, log_dir: Path,
                 kubeconfig: Path | None = None, verbose: bool = True):
        """namespace None: the whole cluster; kubeconfig: other credentials than the admin's;
        verbose: log every handler run (a benchmark turns it off, as a production install has it)."""
        self.control_plane, self.namespace, self.log_dir = control_plane, namespace, log_dir
        self.kubeconfig, self.verbose = kubeconfig, verbose
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.metrics_port = self.health_port = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self, *args: str, **env: str) -> OperatorProcess:
        """Start `rlhf operator` with these extra arguments and environment; return once /healthz answers."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        for _ in range(PORT_ATTEMPTS):
            self.starts += 1
            self.metrics_port, self.health_port = free_ports(2)
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "rlhf_cli.cli", "operator",
                     *(["--namespace", self.namespace] if self.namespace else ["--all-namespaces"]),
                     "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
                     *(["--verbose"] if self.verbose else []), *args],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                    env=self.control_plane.env({**os.environ, **env}) | (
                        {"KUBECONFIG": str(self.kubeconfig)} if self.kubeconfig else {}),
                )
            try:
                # A bound, not an expectation: under the whole suite's load (2 cores, 4 workers, memory near full)
                # its imports and start once took over 60 s.
                wait_for(self.healthy, 180, f"operator /healthz (log {self.log})")
                return self
            except AssertionError:
                # A free port is free only until it is bound: another process may take it in between.
                if self.proc.poll() is None or "address already in use" not in self.log.read_text().lower():
                    raise
        raise AssertionError(f"operator: its ports were taken {PORT_ATTEMPTS} times (log {self.log})")

    def alive(self) -> None:
        """Raises with the exit code and the log's tail when the process has ended."""
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")

    def healthy(self) -> bool:
        self.alive()
        return answers(f"http://127.0.0.1:{self.health_port}/healthz")

    def metrics(self) -> str:
        self.alive()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind, as when a node dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(self.log_dir.glob("operator-*.log")))


@pytest.fixture
def kube(control_plane: ControlPlane) -> Iterator[Kube]:
    client = Kube(control_plane.api_client())
    yield client
    client.api_client.close()


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, kube: Kube, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(control_plane, namespace, tmp_path)
    try:
        yield process
    finally:
        stop_operator(kube, namespace, process)


def stop_operator(kube: Kube, namespace: str, process: OperatorProcess) -> None:
    """The end of a test's operator: its jobs deleted, the process stopped, its logs printed (pytest shows them
    when the test failed)."""
    _delete_jobs(kube, namespace, process)
    process.stop()
    print(process.logs(), file=sys.stderr)


def _delete_jobs(kube: Kube, namespace: str, process: OperatorProcess) -> None:
    """Delete the test's RLHFJobs while the operator can still release its finalizer, else release it here."""
    for job in kube.list(api.KIND, namespace, ""):
        kube.delete(api.KIND, namespace, job["metadata"]["name"], job["metadata"]["uid"])
    if process.proc is not None and process.proc.poll() is None:
        try:
            wait_for(lambda: not kube.list(api.KIND, namespace, ""), 30, "RLHFJobs to be deleted")
        except AssertionError:
            pass
    for job in kube.list(api.KIND, namespace, ""):
        try:
            kube.patch(api.KIND, namespace, job["metadata"]["name"], {"metadata": {"finalizers": None}})
        except ApiException as error:
            if error.status != 404:
                raise


@pytest.fixture(scope="module")
def kuberay_paused(control_plane: ControlPlane) -> Iterator[None]:
    """No KubeRay operator during this module's tests; one that ran before is started again after them."""
    running = control_plane.processes.pop("kuberay-operator", None)
    if running is not None:
        running.stop()
    try:
        yield
    finally:
        if running is not None:
            control_plane.start_kuberay()
