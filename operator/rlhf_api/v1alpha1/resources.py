"""spec.resources (the Ray pods: GPUs, RDMA, placement, environment) and spec.checkpoint."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..contract import MODEL_CACHE_DIR, OPERATOR_POD_ANNOTATIONS, OPERATOR_POD_LABELS, POD_INTERFACE
from .base import APIModel, ObjectName, Passthrough, Quantity, cel, quantity_bytes, section



class EnvVar(APIModel):
    """An environment variable (core/v1 EnvVar). Secrets go through valueFrom.secretKeyRef."""

    model_config = cel(
        ("!has(self.value) || !self.name.matches('(?i)(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY)$')",
         "this variable looks like a secret: reference it with valueFrom.secretKeyRef instead of a literal value"),
    )

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    """Variable name."""
    value: str | None = Field(None, max_length=32768)
    """Literal value."""
    value_from: Passthrough | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


# A label or annotation key (a qualified name): an optional DNS-subdomain prefix of at most 253 and "/", then a
# name of at most 63. A map's keys have no schema of their own, so CEL checks them: [.] and no backslash, since
# the pattern sits in a CEL string literal; the second match bounds the prefix (CEL has no split here).
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
QUALIFIED_PREFIX = r"^[-a-z0-9.]{1,253}/"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _pod_metadata(what: str, operator_keys: tuple[str, ...], value: Any) -> Any:
    """A map of pod labels or annotations: keys as Kubernetes checks them, none of the operator's own."""
    keys = ", ".join(operator_keys)
    rules = [
        {"rule": f"self.all(k, k.matches('{QUALIFIED_NAME}') && (!k.contains('/') || k.matches('{QUALIFIED_PREFIX}')))",
         "message": f"each {what} key is a name of at most 63 characters (letters, digits, '-', '_', '.', alphanumeric "
                    "at both ends), optionally after a lowercase DNS subdomain prefix and '/', e.g. example.com/team"},
        {"rule": "!self.exists(k, k in [" + ", ".join(f"'{key}'" for key in operator_keys) + "])",
         "message": f"the operator sets the {what}s {keys} itself: remove them"},
    ]
    # 32 annotations of at most 4Ki stay well within a pod's 256Ki of annotations, the operator's included.
    return Annotated[dict[str, value], Field(max_length=32, json_schema_extra={"x-kubernetes-validations": rules})]


PodLabels = _pod_metadata("label", OPERATOR_POD_LABELS, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)])
PodAnnotations = _pod_metadata("annotation", OPERATOR_POD_ANNOTATIONS, Annotated[str, Field(max_length=4096)])


class RDMASpec(APIModel):
    """RDMA (InfiniBand/RoCE) for NCCL between GPU nodes."""

    resource_name: str = Field("rdma/ib", max_length=253)
    """Extended resource the RDMA device plugin advertises (e.g. rdma/ib, rdma/rdma_shared_device_a, nvidia.com/hostdev)."""
    resource_count: int = Field(1, ge=1)
    """Units of that resource per worker pod."""
    hca: str = Field("mlx5", max_length=512, pattern=r"^\^?=?[-A-Za-z0-9_.]+(:[0-9]+)?(,[-A-Za-z0-9_.]+(:[0-9]+)?)*$")
    """NCCL_IB_HCA: the host channel adapters (and their ports) NCCL uses, in NCCL's syntax: a comma-separated list of device names, each optionally with :port (e.g. mlx5_0:1); a leading = matches the names exactly instead of as prefixes, a leading ^ excludes them instead (^= excludes exact names). The default mlx5 is a prefix: it also matches a ConnectX port in Ethernet mode that is not on the GPU fabric (a node's own network); on RoCE name the fabric's ports exactly, e.g. =mlx5_0:1,mlx5_1:1 (ibv_devinfo lists them), or exclude the others, e.g. ^=mlx5_2."""
    socket_ifname: str = Field(POD_INTERFACE, max_length=256)
    """NCCL_SOCKET_IFNAME of the GPU workers: the interface for NCCL's bootstrap and socket traffic (without rdma: eth0, the pod network's interface, as for Gloo's GLOO_SOCKET_IFNAME); a variable of that name in resources.env wins."""
    gdr_level: Literal["LOC", "PIX", "PXB", "PHB", "SYS"] = "PHB"
    """NCCL_NET_GDR_LEVEL: the farthest topology distance at which GPUDirect RDMA is used."""
    gid_index: int | None = Field(None, ge=0, le=255)
    """NCCL_IB_GID_INDEX: the entry of the adapters' GID table NCCL addresses RoCE traffic with; RoCE v2 over IPv4 is usually 3 (show_gids lists the table). Unset: NCCL picks one itself."""
    traffic_class: int | None = Field(None, ge=0, le=255)
    """NCCL_IB_TC: the traffic class of NCCL's RDMA packets; on RoCE, the class the fabric's switches give lossless (PFC) treatment, as its administrators configured it (e.g. 106). Unset: NCCL's default (0)."""
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    """NCCL_DEBUG level."""
    require_locked_memory: bool = False
    """Fail the job (reason NodeUnusable) when a GPU rank may not lock memory without limit, instead of warning in its log: NCCL registers its buffers with the adapters by locking them, which can fail mid-run under a limit. A stock containerd or CRI-O sets one; LimitMEMLOCK=infinity in its systemd unit lifts it."""


NodeSelector = dict[str, Annotated[str, Field(max_length=63)]]
Tolerations = Annotated[list[Passthrough], Field(max_length=32)]


class PodResources(APIModel):
    """CPU, memory and placement of one kind of pod (the head, or each worker)."""

    cpu: Quantity = "8"
    """CPU request and limit."""
    memory: Quantity = "32Gi"
    """Memory request and limit."""
    node_selector: NodeSelector | None = None
    """Node labels these pods require besides resources.nodeSelector (their own value of a key wins): e.g. the head on a CPU pool and the workers on the GPU pool. The head's apply to KubeRay's submitter too; a job of one node with claims has its head on its worker's node, placed as the worker."""
    tolerations: Tolerations | None = None
    """Tolerations (core/v1 Toleration) of these pods besides resources.tolerations: e.g. the GPU pool's own taint on the workers alone, so that the head cannot take a GPU node's place."""
    affinity: Passthrough | None = None
    """Affinity (core/v1 Affinity) of these pods in place of resources.affinity (GPU workers still require gpuProduct)."""


# A GPU worker pod's memory when resources.worker.memory is unset, per GPU on top of its /dev/shm: what the memory
# plan's host column (rlhf_api/planning/memory.py) gives each GPU of the GPU examples, with room: the processes on
# the GPU (a rank of each colocated model and a vLLM worker, ~3 GiB each with CUDA's host libraries) and vLLM's
# pinned copy of its weights while it sleeps (an 8B model at tensor-parallel 2: ~7.5 GiB). A test holds every GPU
# example's plan to it.
WORKER_MEMORY_PER_GPU = "32Gi"


class WorkerResources(PodResources):
    """CPU and memory of each Ray worker pod."""

    pod_annotations: PodAnnotations | None = None
    """Annotations of the worker pods only, over resources.podAnnotations: e.g. a Multus network that only the GPU nodes offer (k8s.v1.cni.cncf.io/networks: roce-net), which would keep the head from starting on a node without it."""
    memory: Quantity | None = None
    """Memory request and limit; unset: resources.shmSize plus 32Gi per GPU (what the memory plan's host column needs for the GPU examples: `rlhf validate --gpu` prints it), 32Gi on CPU workers. /dev/shm is memory-backed and counts against this limit."""


class HeadResources(PodResources):
    """CPU and memory of the Ray head pod (the trainer driver: no model weights, no GPUs)."""

    # Its own field defaults, so that head: {} and an absent head mean the same.
    cpu: Quantity = "4"
    """CPU request and limit."""
    memory: Quantity = "16Gi"
    """Memory request and limit."""


class RoleGPUs(APIModel):
    """GPUs per role when roles do not share GPUs (training.colocation none or actor-reference). Unset roles are sized automatically."""

    actor: int | None = Field(None, ge=1)
    """GPUs of the actor group (data-parallel ZeRO ranks)."""
    critic: int | None = Field(None, ge=1)
    """GPUs of the critic group."""
    reference: int | None = Field(None, ge=1)
    """GPUs of the reference group."""
    reward: int | None = Field(None, ge=1)
    """GPUs of the reward-model group."""
    teacher: int | None = Field(None, ge=1)
    """GPUs of the teacher group (distill)."""


# A node label's name (Kubernetes' qualified name, optionally prefixed): a Kueue Topology's levels are node labels.
LABEL_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class TopologySpec(APIModel):
    """Topology-aware placement of the GPU workers by Kueue (its Topology-Aware Scheduling): all of them within one domain of a topology level, such as one rack or one NVLink block."""

    level: str = Field(max_length=316, pattern=LABEL_NAME)
    """The level: the node label of one of the levels of the Kueue Topology named by the queue's ResourceFlavor (topologyName), e.g. cloud.provider.com/topology-rack."""
    mode: Literal["Required", "Preferred"] = "Required"
    """Required: the job stays queued until its workers fit within one domain of that level. Preferred: Kueue tries that level, then the levels above it, and else admits the workers spread over several domains."""


# A claim's access mode is the PersistentVolumeClaim's, which no CEL rule can read (CEL sees only this object):
# whether the job's pods can share it is checked by the operator (rlhf_operator/checks.py), before any pod exists.
class ModelCacheSpec(APIModel):
    """A Hugging Face cache on a PersistentVolumeClaim: models, tokenizers and datasets named by hub id are downloaded there once, and a retry or the next job that mounts it reads them from there instead of fetching them again."""

    model_config = cel(("!self.subPath.startsWith('/') && !('/' + self.subPath + '/').contains('/../')",
                        "subPath is a directory inside the volume: a relative path without '..'", ".subPath"))

    pvc: ObjectName = Field(description=(
        f"Name of the PersistentVolumeClaim, mounted read-write on the head and every worker at {MODEL_CACHE_DIR} with "
        "HF_HOME set to it (the hub's and the datasets' caches follow). With several nodes it must be ReadWriteMany "
        "(their pods download into it at once, under the cache's file locks); a job of one node may use a "
        "ReadWriteOnce claim (its head runs on the worker's node)."))
    sub_path: str = Field("", max_length=1024)
    """Directory inside the volume that holds the cache (created when missing); empty: the volume's root."""


class ResourcesSpec(APIModel):
    """Where and on what the job runs: the Ray cluster's pods."""

    model_config = cel(
        ("!has(self.rdma) || self.gpusPerNode > 0", "RDMA is only for GPU workers: set gpusPerNode > 0 or remove rdma", ".rdma"),
        ("!has(self.gpuProduct) || self.gpusPerNode > 0", "gpuProduct selects GPU nodes: set gpusPerNode > 0 or remove gpuProduct", ".gpuProduct"),
        ("!self.hostNetwork || self.gpusPerNode > 0", "hostNetwork is for NCCL between GPU workers: set gpusPerNode > 0 or remove hostNetwork", ".hostNetwork"),
    )

    image: str | None = Field(None, max_length=1024)
    """Trainer image for the Ray head and workers; unset: the runtime's for the job's device, else the operator installation's (chart values trainer.repository and trainer.tag: the -cuda tag for a GPU job, -cpu for a CPU job)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy."""
    image_pull_secrets: list[ObjectName] = Field(default_factory=list, max_length=16)
    """Names of Secrets used to pull the image."""
    nodes: int = Field(1, ge=1, le=1024)
    """GPU worker pods (one per node)."""
    gpus_per_node: int = Field(8, ge=0, le=64)
    """GPUs per worker pod; 0 runs on CPU workers."""
    gpu_resource_name: str = Field("nvidia.com/gpu", max_length=253)
    """Extended resource name of a GPU."""
    gpu_product: str | None = Field(None, max_length=253)
    """Required value of the node label nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3)."""
    gpus: RoleGPUs = section(RoleGPUs)
    """Per-role GPU counts."""
    head: HeadResources = section(HeadResources)
    """Ray head pod (runs the trainer driver, no GPUs)."""
    worker: WorkerResources = section(WorkerResources)
    """Each worker pod."""
    shm_size: Quantity = "16Gi"
    """Size of the memory-backed /dev/shm as a quantity such as 16Gi (NCCL and vLLM need more than the 64Mi default)."""
    rdma: RDMASpec | None = None
    """Enable RDMA for NCCL (adds the RDMA resource and NCCL_* settings to the GPU workers, whose ranks refuse to start unless they may lock memory without limit: the nodes' container runtime must give pods an unlimited memlock)."""
    node_selector: NodeSelector = Field(default_factory=dict)
    """Node labels every pod of the job requires: the Ray head, the workers and KubeRay's submitter (head.nodeSelector and worker.nodeSelector add those of one kind)."""
    tolerations: Tolerations = Field(default_factory=list)
    """Tolerations (core/v1 Toleration) of every pod of the job (head, workers, submitter); GPU workers tolerate the GPU taint already (head.tolerations and worker.tolerations add those of one kind)."""
    affinity: Passthrough | None = None
    """Affinity (core/v1 Affinity) of every pod of the job (head, workers, submitter) that head.affinity or worker.affinity does not replace; GPU workers also require gpuProduct."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    """Environment of the trainer and workers (e.g. HF_TOKEN from a Secret); a variable set here replaces the operator's own of that name (e.g. NCCL_SOCKET_IFNAME, see rdma.socketIfname)."""
    env_from: list[Passthrough] = Field(default_factory=list, max_length=16)
    """Environment from ConfigMaps or Secrets (core/v1 EnvFromSource), by reference."""
    priority_class_name: ObjectName | None = None
    """PriorityClass of the pods."""
    topology: TopologySpec | None = None
    """Place the GPU workers within one topology domain (Kueue's Topology-Aware Scheduling; needs spec.queueName)."""
    pod_labels: PodLabels | None = None
    """Labels of the Ray head and worker pods (e.g. a team or cost-centre label). The operator's own (app.kubernetes.io/managed-by, rlhf.dev/job, rlhf.dev/role: it finds the job's pods by them) cannot be set here; KubeRay's ray.io/ labels are KubeRay's."""
    pod_annotations: PodAnnotations | None = None
    """Annotations of the Ray head and worker pods; worker.podAnnotations adds the workers' own (a Multus network for the GPU workers goes there). The operator's own (rlhf.dev/job-name, Kueue's podset topology annotations: see topology) cannot be set here."""
    host_network: bool = False
    """Run the GPU worker pods on their node's network (hostNetwork, with dnsPolicy ClusterFirstWithHostNet so that they still resolve the head's Service), for clusters whose NCCL uses the hosts' own interfaces. The head stays on the pod network: it runs no NCCL. Each worker holds Ray's fixed ports on its node as host ports (8080 for metrics, 52365 for the dashboard agent), so the scheduler puts at most one such Ray pod on a node, of any job. NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME still name eth0, then the host's interface of that name (some clouds' hosts have one): on hosts whose interface is named otherwise, name it with rdma.socketIfname or NCCL_SOCKET_IFNAME, and GLOO_SOCKET_IFNAME, in env. PodSecurity's baseline and restricted levels refuse a pod on the host network: the job's namespace needs the privileged level."""
    model_cache: ModelCacheSpec | None = None
    """A Hugging Face cache on a claim (HF_HOME on every pod), so that models and datasets named by hub id are downloaded once, not by every pod on every attempt."""

    @property
    def worker_memory(self) -> str:
        """The worker pods' memory: worker.memory, else shmSize plus WORKER_MEMORY_PER_GPU per GPU (32Gi on CPU)."""
        if self.worker.memory is not None:
            return self.worker.memory
        if self.gpus_per_node == 0:
            return WORKER_MEMORY_PER_GPU
        total = quantity_bytes(self.shm_size) + self.gpus_per_node * quantity_bytes(WORKER_MEMORY_PER_GPU)
        return f"{-(-total // 2**30)}Gi"


# ------------------------------------------------------------------------------------- checkpoint


class CheckpointSpec(APIModel):
    """Checkpointing and resume."""

    model_config = cel(
        ("self.keep > 0 || !has(self.intervalSteps) || self.intervalSteps == 0",
         "keep: 0 writes no checkpoint, so there is none every intervalSteps: set intervalSteps to 0 or keep to 1 "
         "or more", ".intervalSteps"),
        ("self.keep > 0 || self.exportHf", "keep: 0 without exportHf leaves nothing of the run: set exportHf: true "
         "or keep to 1 or more", ".keep"))

    pvc: ObjectName | None = None
    """Name of the PersistentVolumeClaim mounted at path on every pod, at the volume's subdirectory named after the job: jobs sharing a claim never see each other's checkpoints, and a job re-created under the same name resumes from its predecessor's (set resume: false to start over). Without it, checkpoints live in the pod and die with it."""
    path: str = Field("/checkpoints", max_length=1024)
    """Directory for checkpoints and the final model."""
    interval_steps: int = Field(0, ge=0)
    """Save every N steps; 0 saves only at the end."""
    keep: int = Field(3, ge=0, le=1000)
    """Number of checkpoints kept (oldest removed first). 0 writes none, at the end or on SIGTERM either: only the final export (exportHf) is left, and a stopped run starts over. For a pipeline's stage, whose next stage reads only the export, that saves the disk of the optimizer's state (OpenRLHF's --disable_ds_ckpt)."""
    resume: bool = True
    """Resume from the newest checkpoint under path when one exists."""
    export_hf: bool = True
    """Export the final actor in Hugging Face format to path/final."""
