"""The seam where no container runtime exists: play the kubelet and KubeRay for a RayJob's head pod.

Under kwok, pods never run. For the end-to-end tests this module does, on this machine, what the
kubelet and KubeRay would do for the head pod of a RayJob the operator created.

The head container's volumes, mounted at its volumeMounts (subPath and readOnly honoured) inside
a private mount namespace, so the processes inside see the pod's filesystem and the host's stays
as it was (at most an empty directory is left where a mount point's parent was missing):

- configMap and secret volumes: their keys (or `items`) written out as files, mounted read-only
  as the kubelet does;
- persistentVolumeClaim volumes: the claim is looked up through the API server and must be Bound
  to a PersistentVolume whose `local` or `hostPath` directory is on this machine (e2e/storage.py);
  else start() raises VolumeNotReady, where a real pod would stay Pending. A missing subPath
  directory is created in the volume, as the kubelet does; `readOnly` on the claim or the mount
  makes the mount read-only;
- emptyDir volumes: a fresh directory per pod, with a tmpfs (of the volume's sizeLimit) on it for
  medium Memory. /dev/shm is such a tmpfs here too, the job's shmSize: smaller than the object
  store Ray wants (30% of RAM), so Ray keeps its object store in its temp dir with a warning, as
  in such a pod, and still runs;
- the ServiceAccount token the kubelet projects: a real TokenRequest for the pod's ServiceAccount,
  with the cluster CA, at /var/run/secrets/kubernetes.io/serviceaccount.

The container's env is resolved (literals, fieldRef, ConfigMap/Secret keys and envFrom) and
KUBERNETES_SERVICE_HOST/PORT point at the API server, so in-cluster config works unchanged. Then a
real Ray head starts there, the RayJob's entrypoint is submitted with its runtime env through
Ray's Jobs API, and the RayJob status KubeRay writes as the Ray job moves is written (see
e2e/operator/kuberay.py for that status shape).

A Ray job that fails with attempts left (RayJob spec.backoffLimit) leaves the RayJob Retrying, as
KubeRay does; `retry()` then does KubeRay's part of a retry: the attempt's cluster deleted (this
head stopped), the RayJob back to New, and a new head started, with a new cluster name and
submission id, whose Ray job is submitted by `run_job()` again.

What it does not do: pull images (the local virtualenv is the "image"), worker pods (the head
has the whole cluster's CPUs), GPUs, resource limits, other volume types (start() raises), file
modes and `optional` references.
"""

from __future__ import annotations

import base64
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from kubernetes.utils import parse_quantity

from e2e.controlplane import ControlPlane, free_ports
from e2e.operator.kuberay import RayJobStatus, random_suffix
from e2e.storage import claim_directory, sub_path
from rlhf_operator.kube import Kube

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# What a pod sees of this process's environment: what the "image" (this machine and its virtualenv)
# would set; the pod adds PYTHONUNBUFFERED, as the trainer image's ENV does.
IMAGE_ENV = frozenset({"PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"})


class Mount(NamedTuple):
    source: Path  # a file or directory on this machine
    target: str  # the container's mountPath
    read_only: bool = False


class Volume(NamedTuple):
    path: Path  # the volume's root directory on this machine
    read_only: bool = False  # forced by the volume's source (ConfigMap and Secret data, a read-only claim)
    tmpfs: str | None = None  # mount options of the tmpfs backing a memory emptyDir


def bind_script(mounts: Iterable[tuple], tmpfs: Iterable[tuple[Path, str]] = ()) -> str:
    """Shell lines that mount the pod's volumes inside the private mount namespace.

    mounts: Mount or (source, target) pairs, shallowest target first. tmpfs: (directory, options)
    of each memory emptyDir, mounted first so that its mounts bind the tmpfs. A missing directory
    source is created (a subPath the volume lacks, as the kubelet does). The parent of each
    mountPath gets a private tmpfs first, so files and directories created as mount points stay in
    the namespace (the host keeps at most the empty parent directory).
    """
    lines = [f"mount -t tmpfs -o {shlex.quote(options)} tmpfs {shlex.quote(str(path))}" for path, options in tmpfs]
    for source, target, read_only in (Mount(*mount) for mount in mounts):
        src, dst, parent = (shlex.quote(str(path)) for path in (source, target, Path(target).parent))
        point = f"touch {dst}" if source.is_file() else f"mkdir -p {src} {dst}"
        lines += [f"mkdir -p {parent}", f"mountpoint -q {parent} || mount -t tmpfs tmpfs {parent}", point,
                  f"mount --bind {src} {dst}"]
        if read_only:  # a bind mount takes the read-only flag only on a remount
            lines.append(f"mount -o remount,bind,ro {dst}")
    return "".join(line + "\n" for line in lines)


TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


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

    def _volume(self, volume: dict[str, Any]) -> Volume:
        """The volume made on this machine, as the kubelet makes it before the containers start."""
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            return Volume(claim_directory(self.core, self.namespace, claim["claimName"]), claim.get("readOnly", False))
        if "emptyDir" in volume:
            return self._empty_dir(volume["name"], volume["emptyDir"])
        if "configMap" in volume or "secret" in volume:
            return Volume(self._data_files(volume), read_only=True)
        raise NotImplementedError(f"volume {volume['name']}: this pod runtime plays configMap, secret, "
                                  "persistentVolumeClaim and emptyDir volumes only")

    def _volume_dir(self, name: str) -> Path:
        path = self.root / "volumes" / name
        path.mkdir(parents=True)
        return path

    def _empty_dir(self, name: str, empty_dir: dict[str, Any]) -> Volume:
        """A fresh directory; for medium Memory, a tmpfs of the sizeLimit on it (mounted in the namespace)."""
        if empty_dir.get("medium") != "Memory":
            return Volume(self._volume_dir(name))
        size = empty_dir.get("sizeLimit")
        options = "mode=1777" + (f",size={int(parse_quantity(size))}" if size else "")
        return Volume(self._volume_dir(name), tmpfs=options)

    def _data_files(self, volume: dict[str, Any]) -> Path:
        """A ConfigMap or Secret volume written out as files: every key, or the `items` listed."""
        kind, source = ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
        data = self._data(kind, source.get("name") or source["secretName"])
        target = self._volume_dir(volume["name"])
        for item in source.get("items") or [{"key": key, "path": key} for key in data]:
            path = sub_path(target, item["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data[item["key"]])
        return target

    def _service_account(self) -> Path:
        """A token of the pod's ServiceAccount, as the kubelet's projected volume holds it."""
        account = self.pod.get("serviceAccountName", "default")
        token = self.core.create_namespaced_service_account_token(
            account, self.namespace, {"spec": {"expirationSeconds": 3600}}).status.token
        target = self.root / "serviceaccount"
        target.mkdir()
        (target / "token").write_text(token)
        (target / "namespace").write_text(self.namespace)
        (target / "ca.crt").write_bytes((self.cp.pki / "ca.crt").read_bytes())
        return target

    def _env(self) -> dict[str, str]:
        # A container gets its image's environment and its pod's, never its node's: what this
        # process holds (a W&B service's socket, KUBECONFIG, RAY_ADDRESS...) must not reach the pod.
        env = {k: v for k, v in os.environ.items() if k in IMAGE_ENV}
        fields = {"metadata.namespace": self.namespace, "metadata.name": f"{self.name}-head",
                  "spec.serviceAccountName": self.pod.get("serviceAccountName", "default")}
        for source in self.container.get("envFrom", []):
            ref = source.get("configMapRef") or source.get("secretRef")
            kind = "ConfigMap" if "configMapRef" in source else "Secret"
            env.update({source.get("prefix", "") + k: v for k, v in self._data(kind, ref["name"]).items()})
        for var in self.container.get("env", []):
            value_from = var.get("valueFrom", {})
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "fieldRef" in value_from:
                env[var["name"]] = fields[value_from["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
                kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
                ref = value_from.get("configMapKeyRef") or value_from.get("secretKeyRef")
                env[var["name"]] = self._data(kind, ref["name"])[ref["key"]]
        port = self.cp.ports["kube-apiserver"]
        env.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(port),
                   RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                   PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
        return env

    def _data(self, kind: str, name: str) -> dict[str, str]:
        if kind == "Secret":
            secret = self.core.read_namespaced_secret(name, self.namespace)
            return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        return self.core.read_namespaced_config_map(name, self.namespace).data or {}

    def _mounts(self, volumes: dict[str, Volume], account: Path) -> list[Mount]:
        mounts = [Mount(account, SA_MOUNT, read_only=True)]
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            mounts.append(Mount(sub_path(volume.path, mount.get("subPath", "")), mount["mountPath"],
                                volume.read_only or mount.get("readOnly", False)))
        return sorted(mounts, key=lambda m: m.target.count("/"))

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
        volumes = {volume["name"]: self._volume(volume) for volume in self.pod.get("volumes", [])}
        mounts = self._mounts(volumes, self._service_account())
        tmpfs = [(volume.path, volume.tmpfs) for volume in volumes.values() if volume.tmpfs]
        # Every port Ray would otherwise take at its fixed default is chosen free: a pod has its own
        # network namespace, this machine does not.
        names = ["port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port",
                 "ray-client-server-port"]
        ports = dict(zip(names, free_ports(len(names))))
        self.dashboard_port = ports["dashboard-port"]
        ray = ["ray", "start", "--head", "--block", f"--num-cpus={self._cluster_cpus()}", "--num-gpus=0",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--temp-dir={self.root / 'ray'}",
               "--disable-usage-stats", *(f"--{name}={port}" for name, port in ports.items())]
        script = f"set -e\n{bind_script(mounts, tmpfs)}exec {shlex.join(ray)}\n"
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
        """Submit as KubeRay's submitter does, retrying while the head's job agent is still starting."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                              submission_id=self.job_id)
            except RuntimeError as error:
                if "No available agent" not in str(error) or time.monotonic() > deadline:
                    raise
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
            info = self.client.get_job_info(job_id)
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

    def retry(self) -> HeadPod:
        """KubeRay's retry after `run_job` left the RayJob Retrying: a new head in place of this one."""
        assert self.kube.get("RayJob", self.namespace, self.name)["status"]["jobDeploymentStatus"] == "Retrying"
        self.stop()  # KubeRay deletes the failed attempt's RayCluster (and submitter) ...
        self.status.retried()  # ... then resets the cluster and job fields: New
        return HeadPod(self.cp, self.kube, self.core, self.namespace, self.name).start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
