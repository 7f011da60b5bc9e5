"""The kubelet of a Node this machine plays: the pods the scheduler binds to it run here for real.

The Node carries no kwok annotation, so kwok leaves it and its pods alone. It is tainted (only
pods that tolerate NODE_TAINT land on it: other tests' pods stay on kwok's nodes) and labelled
NODE_LABEL (a job selects it with spec.resources.nodeSelector). The runtime keeps it Ready (status
and Lease heartbeats) and, for each pod bound to it: a network namespace and IP (network.py), its
volumes (volumes.py, group-owned per fsGroup: users.py), its init containers one after another,
then its container (processes.py) with status written as a kubelet writes it (podIP, Running,
Ready from the readiness probe, container states, Succeeded/Failed with the exit code). A container
that exits is restarted unless the pod's restartPolicy says otherwise. A pod being deleted has its
processes stopped (its container's preStop exec hook run first, then SIGTERM, SIGKILL once the
deletion's grace period has passed) and is then deleted with grace period 0, as the kubelet
confirms a deletion.
Its HTTPS server (logs.py) serves `kubectl logs` and port-forwards (portforward.py: `rlhf dashboard`).
A pod's processes are all those in its network namespace (Ray's may leave the container's session);
peak_rss records the most each pod's process tree held, sampled every half second.

Each container runs in a writable copy of its image's filesystem (rootfs.py), from the suite's
image store; an image that store lacks is pulled into it as the container's imagePullPolicy says, with
the kubelet's Pulling/Pulled events (under Never it fails the pod: ErrImageNeverPull). Not played:
image pull secrets and back-off (a failed pull fails the pod: ErrImagePull), GPUs and other devices,
resource enforcement (Ray sees CPU and
memory as KubeRay writes them into `ray start`), liveness probes, sidecar and multi-container pods
(such a pod fails), a hard open-files limit above this machine's.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.pods import network, processes, rootfs, users, volumes
from e2e.pods.logs import KubeletServer

NODE_LABEL = "rlhf.dev/pod-runtime"
NODE_TAINT = {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}
LEASE_SECONDS = 40
DEFAULT_GRACE_SECONDS = 30  # a pod's terminationGracePeriodSeconds when it sets none
POD_PREFIX = "pod-"  # of each pod's network namespace and its containers' writable layers
PRESTOP_EXTRA_GRACE_SECONDS = 2  # the kubelet's: SIGTERM still gets this long after a hook that used up the grace


def now(micro: bool = False) -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    def __init__(self, api_client: Any, api_port: int, ca: Path, root: Path, cluster_hosts: Path | None = None,
                 node: str = "pod-runtime-0", cpu: str = "16", memory: str = "64Gi", tainted: bool = True):
        """cluster_hosts: the hosts file of processes outside the pods (KubeRay's), kept with every Service's name.
        tainted: only pods that tolerate NODE_TAINT land here (beside kwok's nodes); the dev cluster's only
        node is not."""
        self.api = api_client
        self.cluster_hosts = cluster_hosts
        self.base_hosts = cluster_hosts.read_text() if cluster_hosts is not None else ""
        self.cluster_text = None
        self.core, self.discovery = client.CoreV1Api(api_client), client.DiscoveryV1Api(api_client)
        self.ca, self.root, self.node, self.cpu, self.memory, self.tainted = ca, root, node, cpu, memory, tainted
        self.network = network.PodNetwork(api_port)
        self.pods: dict[str, Pod] = {}  # by uid
        self.hosts: dict[str, network.HostsFile] = {}  # by namespace
        self.peak_rss: dict[str, int] = {}  # pod name -> the most its process tree held
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.server: KubeletServer | None = None

    def start(self) -> Kubelet:
        self.root.mkdir(parents=True, exist_ok=True)
        rootfs.remove_stale(POD_PREFIX)
        self.network.up()
        self.server = KubeletServer(self.find, self.ca.parent, network.GATEWAY, self.node).start()
        self._register()
        for loop in (self._heartbeats, self._sync):
            threading.Thread(target=loop, daemon=True, name=f"kubelet-{loop.__name__}").start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        pods = list(self.pods.values())
        for pod in pods:
            pod.kill()
        for pod in pods:  # each lets its network namespace and API object go
            pod.thread.join(30)
        try:
            self.core.delete_node(self.node)
        except ApiException:
            pass
        if self.server is not None:
            self.server.stop()
        self.network.down()
        if self.cluster_hosts is not None:
            network.write_in_place(self.cluster_hosts, self.base_hosts)

    def find(self, namespace: str, name: str) -> Pod | None:
        return next((p for p in list(self.pods.values()) if (p.namespace, p.name) == (namespace, name)), None)

    def kill(self, namespace: str, name: str) -> None:
        """SIGKILL a pod's container, as an OOM kill or a crash would: the kubelet restarts it per restartPolicy."""
        self.find(namespace, name).sweep()

    # ------------------------------------------------------------------------------------ the Node

    def _register(self) -> None:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "100Gi"}
        body = {"metadata": {"name": self.node, "labels": {
                    NODE_LABEL: "true", "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64"}},
                "spec": {"taints": [NODE_TAINT] if self.tainted else []},
                "status": {"capacity": resources, "allocatable": resources,
                           "addresses": [{"type": "InternalIP", "address": network.GATEWAY},
                                         {"type": "Hostname", "address": self.node}],
                           "daemonEndpoints": {"kubeletEndpoint": {"Port": self.server.port}},
                           "conditions": [self._ready()]}}
        try:
            self.core.delete_node(self.node)  # a crashed run's
        except ApiException:
            pass
        self.core.create_node(body)
        self.core.patch_node_status(self.node, {"status": body["status"]})

    def _ready(self) -> dict[str, str]:
        return {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e pod runtime",
                "lastHeartbeatTime": now(), "lastTransitionTime": now()}

    def _heartbeats(self) -> None:
        leases = client.CoordinationV1Api(self.api)
        beat = 0.0
        while not self.stopping.wait(beat):
            beat = 10
            lease = {"metadata": {"name": self.node}, "spec": {
                "holderIdentity": self.node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now(micro=True)}}
            try:
                try:
                    leases.patch_namespaced_lease(self.node, "kube-node-lease", lease)
                except ApiException as error:
                    if error.status != 404:
                        raise
                    leases.create_namespaced_lease("kube-node-lease", lease)
                self.core.patch_node_status(self.node, {"status": {"conditions": [self._ready()]}})
            except Exception as error:  # noqa: BLE001 - the API server may be restarting; beat again
                self.errors.append(f"heartbeat: {error}")

    # ------------------------------------------------------------------------------------ the pods

    def _sync(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                self._sync_once()
            except Exception as error:  # noqa: BLE001 - logged; the next round tries again
                self.errors.append(f"sync: {error!r}")

    def _sync_once(self) -> None:
        listed = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
        seen = set()
        for item in listed:
            pod = self.api.sanitize_for_serialization(item)
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            if uid not in self.pods and not pod["metadata"].get("deletionTimestamp") \
                    and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                self.pods[uid] = Pod(self, pod).start()
            elif uid in self.pods and pod["metadata"].get("deletionTimestamp"):
                self.pods[uid].delete(pod["metadata"].get("deletionGracePeriodSeconds"))
        for uid in set(self.pods) - seen:  # deleted without us (force-deleted)
            self.pods.pop(uid).kill()
        rss = processes.rss_by_session()
        for pod in self.pods.values():
            if pod.process is not None:
                self.peak_rss[pod.name] = max(rss.get(pod.process.pid, 0), self.peak_rss.get(pod.name, 0))
        for namespace in {pod.namespace for pod in self.pods.values()}:
            self._hosts(namespace).update(
                {p.name: p.ip for p in self.pods.values() if p.namespace == namespace and p.ip},
                self.discovery.list_namespaced_endpoint_slice(namespace).items)
        self.network.names = {
            f"kubernetes.default.svc.{network.CLUSTER_DOMAIN}": network.KUBERNETES_SERVICE[0],
            **{network.service_names(service, f.namespace)[0]: address
               for f in self.hosts.values() for service, address in f.services.items()}}
        if self.cluster_hosts is not None:
            self.cluster_text = network.write_in_place(
                self.cluster_hosts, network.cluster_hosts(self.base_hosts, list(self.hosts.values())), self.cluster_text)

    def _hosts(self, namespace: str) -> network.HostsFile:
        if namespace not in self.hosts:
            self.hosts[namespace] = network.HostsFile(self.root / f"hosts-{namespace}", namespace)
        return self.hosts[namespace]


class Pod:
    """One pod bound to the node, from its sandbox to its deletion; its life runs in a thread of its own."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any]):
        self.kubelet, self.pod, self.spec = kubelet, pod, pod["spec"]
        self.name, self.namespace, self.uid = pod["metadata"]["name"], pod["metadata"]["namespace"], pod["metadata"]["uid"]
        self.root = kubelet.root / "pods" / self.uid
        self.netns = f"{POD_PREFIX}{self.uid[:13]}"  # also its containers' names (rootfs.py)
        self.ip = ""
        self.process = None
        self.deleting = threading.Event()
        self.ended = threading.Event()  # its containers have exited for good (a followed log ends)
        self.grace = float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
        # The running container's user and environment: its exec probes and hooks run as it.
        self.who: users.Identity | None = None
        self.rootfs: rootfs.Rootfs | None = None
        self.env: dict[str, str] = {}
        self.log = self.root / "container.log"
        self.restarts = 0
        self.started_at = now()
        self.thread = threading.Thread(target=self._live, daemon=True, name=f"pod-{self.name}")

    def start(self) -> Pod:
        self.thread.start()
        return self

    def delete(self, grace: float | None = None) -> None:
        """The pod is being deleted: its container stops within `grace` seconds (the deletion's grace period)."""
        if grace is not None:
            self.grace = grace
        self.deleting.set()

    def kill(self) -> None:
        self.deleting.set()
        if self.process is not None:
            processes.stop(self.process, grace=5)

    def sweep(self) -> None:
        """SIGKILL every process of the pod, also those its container moved to sessions of their own."""
        for pid in network.PodNetwork.pids(self.netns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------------------------ its life

    def _live(self) -> None:
        try:
            if len(self.spec["containers"]) > 1:
                raise NotImplementedError("this pod runtime plays pods of one container (and init containers)")
            self.root.mkdir(parents=True, exist_ok=True)
            self.ip = self.kubelet.network.attach(self.netns)
            self._status("Pending", initialized=False)
            made = self._volumes()
            if made is not None and self._init_containers(made):
                self._run(self.spec["containers"][0], made)
        except Exception as error:  # noqa: BLE001 - the pod fails as a kubelet would report it
            self.kubelet.errors.append(f"pod {self.name}: {error!r}")
            self._write({"phase": "Failed", "reason": getattr(error, "reason", "RuntimeError"),
                         "message": str(error)[:2000]})
        finally:
            if self.process is not None:
                processes.stop(self.process, grace=5)
            self.sweep()
            self._remove_rootfs()
            self.ended.set()
            self.deleting.wait()  # a finished pod stays until it is deleted
            self.kubelet.network.detach(self.netns, self.ip)
            try:
                self.kubelet.core.delete_namespaced_pod(self.name, self.namespace, grace_period_seconds=0)
            except ApiException as error:
                if error.status != 404:
                    raise
            self.kubelet.pods.pop(self.uid, None)

    def _volumes(self) -> dict[str, volumes.Volume] | None:
        """The pod's volumes, waited for while a claim is not Bound (the pod stays Pending)."""
        while not self.deleting.is_set():
            shutil.rmtree(self.root / "volumes", ignore_errors=True)
            try:
                made = volumes.make_volumes(self.kubelet.core, self.namespace, self.spec, self.root,
                                            processes.pod_fields(self.pod, self.ip, network.GATEWAY))
                break
            except volumes.VolumeNotReady as error:
                self._write({"phase": "Pending", "message": str(error)})
                self.deleting.wait(2)
        else:
            return None
        security = self.spec.get("securityContext") or {}
        if security.get("fsGroup") is not None:
            for volume in made.values():
                users.own_volume(volume.path, security["fsGroup"], security.get("fsGroupChangePolicy", "Always"))
        return made

    def _launch(self, container: dict[str, Any], made: dict[str, volumes.Volume]) -> None:
        self._remove_rootfs()
        self._pull(container)
        self.rootfs = rootfs.Rootfs(container["image"], f"{self.netns}-{container['name']}")
        image = self.rootfs.config
        self.who = who = users.identity(self.spec, container, self.rootfs.user(image.user))
        hosts = self.kubelet._hosts(self.namespace).path
        resolv = self.root / "resolv.conf"
        resolv.write_text(network.resolv_conf(self.namespace))
        volumes.make_sub_paths(container, made)
        mounts = volumes.container_mounts(container, made, None)
        read_only = (container.get("securityContext") or {}).get("readOnlyRootFilesystem", False)
        script = (processes.root_script(self.rootfs.path, hosts, resolv)
                  + volumes.bind_script(mounts, volumes.memory_tmpfs(made), root=self.rootfs.path)
                  + (processes.read_only_root(self.rootfs.path) if read_only else ""))
        self.env = env = processes.resolve_env(
            container, processes.pod_fields(self.pod, self.ip, network.GATEWAY),
            lambda kind, name: volumes.data(self.kubelet.core, self.namespace, kind, name),
            {"HOME": self.rootfs.home(who.uid), **processes.NODE_ENV, **image.env, "HOSTNAME": self.name,
             "KUBERNETES_SERVICE_HOST": network.KUBERNETES_SERVICE[0],
             "KUBERNETES_SERVICE_PORT": str(network.KUBERNETES_SERVICE[1])})
        argv = [processes.expand(word, env) for word in rootfs.command(container, image)]
        with open(self.log, "a") as log:
            log.write(f"--- {container['name']} ({container['image']}) as {who.uid}:{who.gid} {who.groups} "
                      f"(pod securityContext {self.spec.get('securityContext')}): {argv}\n")
        self.process = processes.launch(self.netns, self.name, script, who, argv, self.rootfs.path,
                                        container.get("workingDir", image.workdir), env, self.log)

    def _pull(self, container: dict[str, Any]) -> None:
        """The container's image into the node's store as its pull policy says (the API server defaults it)."""
        image, policy = container["image"], container.get("imagePullPolicy", "IfNotPresent")
        with rootfs.pulling(image):
            if policy == "Always" or (policy == "IfNotPresent" and not rootfs.present(image)):
                self._event(container, "Pulling", f'Pulling image "{image}"')
                start = time.monotonic()
                rootfs.pull(image)
                self._event(container, "Pulled", f'Successfully pulled image "{image}" in {time.monotonic() - start:.3f}s')
            elif policy == "IfNotPresent":
                self._event(container, "Pulled", f'Container image "{image}" already present on machine')

    def _event(self, container: dict[str, Any], reason: str, message: str) -> None:
        """An Event about the container, as the kubelet records one: best effort, never the pod's failure (a
        namespace being deleted refuses new objects)."""
        field = "initContainers" if container in self.spec.get("initContainers", []) else "containers"
        try:
            self.kubelet.core.create_namespaced_event(self.namespace, {
                "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace, "name": self.name,
                                   "uid": self.uid, "fieldPath": f"spec.{field}{{{container['name']}}}"},
                "reason": reason, "message": message, "type": "Normal", "count": 1, "firstTimestamp": now(),
                "lastTimestamp": now(), "source": {"component": "kubelet", "host": self.kubelet.node}})
        except ApiException:
            pass

    def _remove_rootfs(self) -> None:
        """The last container's writable layer: a container that restarts starts from its image again."""
        if self.rootfs is not None:
            self.rootfs.remove()
            self.rootfs = None

    def _init_containers(self, made: dict[str, volumes.Volume]) -> bool:
        for container in self.spec.get("initContainers", []):
            while True:
                self._launch(container, made)
                code = self._wait_exit()
                self.process = None
                if code == 0:
                    break
                if self.deleting.is_set() or self.spec.get("restartPolicy") == "Never":
                    self._status("Failed", initialized=False, exit_code=code)
                    return False
                self.restarts += 1
                self.deleting.wait(1)
        return not self.deleting.is_set()

    def _run(self, container: dict[str, Any], made: dict[str, volumes.Volume]) -> None:
        policy = self.spec.get("restartPolicy", "Always")
        while not self.deleting.is_set():
            self._launch(container, made)
            self.started_at = now()
            self._status("Running", ready=False)
            code = self._probe_until_exit(container)
            if self.deleting.is_set():
                return
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                self._status("Succeeded" if code == 0 else "Failed", exit_code=code)
                return
            self.restarts += 1
            self.deleting.wait(1)

    def _terminate(self, container: dict[str, Any]) -> None:
        """As a kubelet stops a container of a pod being deleted: the preStop exec hook, then SIGTERM, SIGKILL
        once the grace period (the hook's time included) has passed."""
        deadline = time.monotonic() + self.grace
        hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if hook is not None:
            code = processes.exec_in(self.process.pid, self.who, hook["command"], self.env, timeout=self.grace,
                                     log=self.log)
            with open(self.log, "a") as log:
                log.write(f"--- preStop hook exited {code}\n")
        processes.stop(self.process, grace=max(deadline - time.monotonic(), PRESTOP_EXTRA_GRACE_SECONDS))

    def _wait_exit(self) -> int:
        while self.process.poll() is None:
            if self.deleting.wait(0.5):
                processes.stop(self.process, grace=5)
        return self.process.returncode

    def _probe_until_exit(self, container: dict[str, Any]) -> int:
        """Readiness from the container's readinessProbe (Ready while it passes; at once without one)."""
        probe = container.get("readinessProbe")
        ready, next_probe = False, time.monotonic() + (probe or {}).get("initialDelaySeconds", 0)
        while self.process.poll() is None:
            if self.deleting.wait(0.5):
                self._terminate(container)
                break
            if time.monotonic() < next_probe:
                continue
            passed = self._probe(probe) if probe else True
            next_probe = time.monotonic() + (probe or {}).get("periodSeconds", 10)
            if passed != ready:
                ready = passed
                self._status("Running", ready=ready)
        return self.process.returncode

    def _probe(self, probe: dict[str, Any]) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        if "exec" in probe:
            return processes.exec_in(self.process.pid, self.who, probe["exec"]["command"], self.env, timeout) == 0
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = next((p["containerPort"] for p in self.spec["containers"][0].get("ports", [])
                         if p.get("name") == get["port"]), get["port"])  # a port may be named
            try:
                with urllib.request.urlopen(f"http://{self.ip}:{port}{get.get('path', '/')}",
                                            timeout=timeout) as response:
                    return 200 <= response.status < 400
            except OSError:
                return False
        raise NotImplementedError(f"readiness probe {probe}: exec and httpGet only")

    # ------------------------------------------------------------------------------------ its status

    def _status(self, phase: str, ready: bool = False, initialized: bool = True, exit_code: int | None = None) -> None:
        container = self.spec["containers"][0]
        if exit_code is not None:
            state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                    "startedAt": self.started_at, "finishedAt": now()}}
        elif phase == "Running":
            state = {"running": {"startedAt": self.started_at}}
        else:
            state = {"waiting": {"reason": "PodInitializing" if not initialized else "ContainerCreating"}}
        conditions = {"PodScheduled": True, "PodReadyToStartContainers": True, "Initialized": initialized,
                      "ContainersReady": ready, "Ready": ready}
        self._write({
            "phase": phase, "hostIP": network.GATEWAY, "hostIPs": [{"ip": network.GATEWAY}], "podIP": self.ip,
            "podIPs": [{"ip": self.ip}], "startTime": self.pod["metadata"].get("creationTimestamp") or now(),
            "conditions": [{"type": kind, "status": str(value), "lastTransitionTime": now()}
                           for kind, value in conditions.items()],
            "containerStatuses": [{
                "name": container["name"], "image": container.get("image", ""), "imageID": "", "ready": ready,
                "started": phase == "Running", "restartCount": self.restarts, "state": state,
                "containerID": f"e2e://{self.uid}/{self.restarts}"}],
        })

    def _write(self, status: dict[str, Any]) -> None:
        try:
            self.kubelet.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
        except ApiException as error:
            if error.status != 404:  # a pod already gone has no status to write
                raise
