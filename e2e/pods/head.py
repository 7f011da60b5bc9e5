"""The seam where no container runtime exists: play the kubelet and KubeRay for a RayJob's head pod.

Under kwok, pods never run. For the end-to-end tests this module does, on this machine, what the
kubelet and KubeRay would do for the head pod of a RayJob the operator created.

The head container's volumes (e2e/pods/volumes.py), mounted at its volumeMounts inside a private
mount namespace, so the processes inside see the pod's filesystem and the host's stays as it was.
/dev/shm is the job's shmSize tmpfs: smaller than the object store Ray wants (30% of RAM), so Ray
keeps its object store in its temp dir with a warning, as in such a pod, and still runs.

The container's env is resolved (literals, fieldRef, ConfigMap/Secret keys and envFrom) and
KUBERNETES_SERVICE_HOST/PORT point at the API server, so in-cluster config works unchanged. Then a
real Ray head starts there, the RayJob's entrypoint is submitted with its runtime env through
Ray's Jobs API, and the RayJob status KubeRay writes as the Ray job moves is written (see
e2e/operator/kuberay.py for that status shape).

A Ray job that fails with attempts left (RayJob spec.backoffLimit) leaves the RayJob Retrying, as
KubeRay does. The retry itself (a new cluster) is not played: e2e/operator/test_multipod.py has
KubeRay's own controller retry on its own pods.

This seam is for the tests written before e2e/pods/kubelet.py, which plays every pod KubeRay
creates with KubeRay running. What it does not do: pull images (the local virtualenv is the "image"), worker pods (the head
has the whole cluster's CPUs), GPUs, resource limits, other volume types (start() raises), file
modes and `optional` references.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from e2e.controlplane import ControlPlane, free_ports
from e2e.operator.kuberay import RayJobStatus, random_suffix
from e2e.pods import processes, volumes
from rlhf_api import contract
from rlhf_operator.kube import Kube

# What a pod sees of this process's environment: what the "image" (this machine and its virtualenv)
# would set; the pod adds PYTHONUNBUFFERED, as the trainer image's ENV does.
IMAGE_ENV = frozenset({"PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"})


TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def host_network_ports(env: dict[str, str]) -> dict[str, str]:
    """The pod's fixed ports (the trainer's metrics port) moved to free ones: a pod has its own network
    namespace, this head shares this machine's with every other head the suite's workers start."""
    return {contract.METRICS_PORT_ENV: str(free_ports(1)[0])} if contract.METRICS_PORT_ENV in env else {}


def ray_head_command(cpus: int, temp_dir: Path) -> tuple[list[str], int]:
    """`ray start --head --block` with its job API, and the dashboard's port. Every port Ray would otherwise
    take at its fixed default (8265, 52365 ...) is chosen free: a pod has its own network namespace, this
    machine does not, and two heads on one default port leave one without a job agent."""
    names = ["port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port",
             "ray-client-server-port"]
    ports = dict(zip(names, free_ports(len(names))))
    command = ["ray", "start", "--head", "--block", f"--num-cpus={cpus}", "--num-gpus=0", "--include-dashboard=true",
               "--dashboard-host=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               *(f"--{name}={port}" for name, port in ports.items())]
    return command, ports["dashboard-port"]

class HeadPod:
    def __init__(self, control_plane: ControlPlane, kube: Kube, core: Any, namespace: str, rayjob_name: str):
        """kube: the operator's client (RayJobs); core: a kubernetes CoreV1Api as cluster admin."""
        self.cp, self.kube, self.core, self.namespace, self.name = control_plane, kube, core, namespace, rayjob_name
        self.rayjob = kube.get("RayJob", namespace, rayjob_name)
        template = self.rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
        self.pod = template["spec"]
        self.pod_meta = template.get("metadata", {})
        self.container = self.pod["containers"][0]
        self.root = Path(tempfile.mkdtemp(prefix=f"head-{rayjob_name}-"))
        self.status = RayJobStatus(kube, namespace, rayjob_name)
        self.process: subprocess.Popen | None = None
        self.dashboard_port = 0
        self.job_id = ""  # the submission id KubeRay chose (status.jobId)
        self.log = self.root / "ray-head.log"

    # --------------------------------------------------------------------------- what a kubelet does

    def _env(self) -> dict[str, str]:
        # A container gets its image's environment and its pod's, never its node's: what this
        # process holds (a W&B service's socket, KUBECONFIG, RAY_ADDRESS...) must not reach the pod.
        # This head runs as root on this machine's filesystem, so its "image" variables are this process's.
        fields = {"metadata.namespace": self.namespace, "metadata.name": f"{self.name}-head",
                  "spec.serviceAccountName": self.pod.get("serviceAccountName", "default")}
        env = processes.resolve_env(self.container, fields, self._data,
                                    {"LANG": "C.UTF-8", **processes.NODE_ENV,
                                     **{k: v for k, v in os.environ.items() if k in IMAGE_ENV}})
        port = self.cp.ports["kube-apiserver"]
        env.update(host_network_ports(env))
        env.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(port),
                   RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                   PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
        return env

    def _data(self, kind: str, name: str) -> dict[str, str]:
        return volumes.data(self.core, self.namespace, kind, name)

    def _cluster_cpus(self) -> int:
        """The logical CPUs the whole Ray cluster would have: this one head stands in for the workers too."""
        cluster = self.rayjob["spec"]["rayClusterSpec"]
        groups = [(cluster["headGroupSpec"], 1)] + [(g, g.get("replicas", 1)) for g in cluster.get("workerGroupSpecs", [])]
        total = 0
        for group, replicas in groups:
            cpu = str(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
            total += replicas * max(1, int(float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)))
        return total

    # ------------------------------------------------------------------------------- the Ray head

    def start(self) -> HeadPod:
        # Volumes first: a claim that is not Bound raises here, where a real pod would stay Pending.
        made = volumes.make_volumes(self.core, self.namespace, self.pod, self.root)
        token = volumes.service_account_token(self.core, self.namespace, self.pod.get("serviceAccountName", "default"),
                                              self.cp.pki / "ca.crt", self.root / "serviceaccount")
        mounts = volumes.container_mounts(self.container, made, token)
        tmpfs = volumes.memory_tmpfs(made)
        ray, self.dashboard_port = ray_head_command(self._cluster_cpus(), self.root / "ray")
        script = f"set -e\n{volumes.bind_script(mounts, tmpfs)}exec {shlex.join(ray)}\n"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                                            env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.job_id = self.status.initializing(random_suffix(), random_suffix())["status"]["jobId"]
        self._wait_dashboard()
        return self

    def _wait_dashboard(self, timeout: float = 120) -> None:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray head exited:\n{self.log.read_text()[-3000:]}")
            try:
                self.client = JobSubmissionClient(f"http://127.0.0.1:{self.dashboard_port}")
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        raise TimeoutError(f"Ray dashboard did not come up:\n{self.log.read_text()[-3000:]}")

    def _submit(self, entrypoint: str, runtime_env: dict | None, timeout: float = 120) -> str:
        """Submit as KubeRay's submitter does, retrying while the head's job agent is still starting, and
        after a connection the dashboard dropped unanswered (a loaded machine): the submitter Job's pod
        would be restarted. A retried submission that finds its id taken was accepted the first time."""
        deadline = time.monotonic() + timeout
        retried = False
        while True:
            try:
                return self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                              submission_id=self.job_id)
            except requests.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
            except RuntimeError as error:
                if retried and "already exists" in str(error):
                    return self.job_id
                if "No available agent" not in str(error) or time.monotonic() > deadline:
                    raise
            retried = True
            time.sleep(1)

    def run_job(self, timeout: float = 900) -> tuple[str, str]:
        """Submit the RayJob's entrypoint and follow it as KubeRay does; returns (jobStatus, logs)."""
        spec = self.rayjob["spec"]
        runtime_env = yaml.safe_load(spec["runtimeEnvYAML"]) if spec.get("runtimeEnvYAML") else None
        job_id = self._submit(spec["entrypoint"], runtime_env)
        self.status.write(jobDeploymentStatus="Running", jobStatus="PENDING", jobId=job_id,
                          dashboardURL=f"127.0.0.1:{self.dashboard_port}")
        reported = "PENDING"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = self.client.get_job_info(job_id)
            except requests.exceptions.ConnectionError:  # dropped unanswered on a loaded machine: ask again
                time.sleep(1)
                continue
            state = str(info.status)
            if state != reported and state not in TERMINAL:
                self.status.write(jobDeploymentStatus="Running", jobStatus=state)
                reported = state
            if state in TERMINAL:
                logs = self.client.get_job_logs(job_id)
                if state == "SUCCEEDED":
                    self.status.succeeded()
                else:
                    # KubeRay copies the Ray job's message into the RayJob (AppFailed, or Retrying).
                    self.status.ray_job_failed(info.message or "")
                return state, logs
            time.sleep(1)
        raise TimeoutError(f"Ray job {job_id} did not finish in {timeout:.0f}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
