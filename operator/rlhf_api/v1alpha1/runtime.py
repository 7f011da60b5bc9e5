"""RLHFRuntime and ClusterRLHFRuntime: a cluster's conventions, written once by its platform team.

A runtime holds what jobs on a cluster share and researchers should not have to know: the trainer image per
device, the GPU pool's node selection and taints, RDMA and NCCL settings, pod labels and annotations, image pull
secrets, volumes such as a model cache, default pod sizes, a priority class, a Kueue queue. A job names one
(spec.runtimeRef) or gets the default one; its own fields win field by field (`applied`). Kubeflow Trainer's
TrainingRuntime / ClusterTrainingRuntime are the model: a namespaced kind for a team, a cluster-scoped one for all.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model
from pydantic.fields import FieldInfo

from .base import API_VERSION, APIModel, DNS_SUBDOMAIN, ObjectName, section
from .resources import ResourcesSpec

RUNTIME_KIND = "RLHFRuntime"
CLUSTER_RUNTIME_KIND = "ClusterRLHFRuntime"
RuntimeKind = Literal["ClusterRLHFRuntime", "RLHFRuntime"]
# spec.resources fields that describe the run itself, not the cluster: a runtime leaves them to each job.
JOB_ONLY_RESOURCES = ("nodes", "gpus_per_node", "gpus", "topology")
RUNTIME_RESOURCES = tuple(name for name in ResourcesSpec.model_fields if name not in JOB_ONLY_RESOURCES)


def _unset_by_default(field: FieldInfo) -> FieldInfo:
    """ResourcesSpec's own field (bounds, description) with no default: a runtime sets what it sets."""
    copy = FieldInfo.merge_field_infos(field, default=None)
    copy.default_factory = None
    return copy


RuntimeResources = create_model(
    "RuntimeResources", __base__=APIModel, __doc__="What the runtime sets of its jobs' spec.resources (the same "
    "fields, explained there); a field a job leaves at its default takes the runtime's.",
    **{name: (ResourcesSpec.model_fields[name].annotation | None, _unset_by_default(ResourcesSpec.model_fields[name]))
       for name in RUNTIME_RESOURCES})

LockableField = Literal[tuple(ResourcesSpec.model_fields[name].alias for name in RUNTIME_RESOURCES) + ("queueName",)]


class TrainerImages(APIModel):
    """The trainer image for each device; a job's resources.image wins."""

    cpu: str | None = Field(None, max_length=1024)
    """Image for jobs on CPU workers (resources.gpusPerNode 0): vLLM's CPU build."""
    cuda: str | None = Field(None, max_length=1024)
    """Image for jobs on NVIDIA GPUs."""


class RuntimeRef(APIModel):
    """The runtime a job is made with."""

    kind: RuntimeKind = CLUSTER_RUNTIME_KIND
    """ClusterRLHFRuntime (cluster-wide) or RLHFRuntime (in the job's namespace)."""
    name: ObjectName
    """The runtime's name."""


class RLHFRuntimeSpec(APIModel):
    """A cluster's conventions for the jobs that use this runtime."""

    default: bool = False
    """The runtime of every job that names none: a namespace's default RLHFRuntime, else the default ClusterRLHFRuntime; the oldest when several are marked, so that marking a second one changes nothing until the first is unmarked. Jobs created before it was marked keep what they had."""
    trainer_images: TrainerImages | None = None
    """The trainer image per device, picked by the job's resources.gpusPerNode; unset: the operator's installation's."""
    resources: RuntimeResources = section(RuntimeResources)
    """Defaults of the jobs' spec.resources (node selection, tolerations, RDMA, NCCL environment, pod sizes, labels, annotations, volumes, pull secrets, priority class)."""
    queue_name: str | None = Field(None, max_length=63, pattern=DNS_SUBDOMAIN)
    """Kueue LocalQueue of jobs that name none (in each job's namespace)."""
    locked: list[LockableField] = Field(default_factory=list, max_length=64)
    """spec.resources fields (by their names there, e.g. tolerations, rdma, image) and queueName that jobs may not set themselves: a job that sets one is refused at admission (the operator's webhook, where the chart installs it), else fails with reason RuntimeFieldLocked."""


class RLHFRuntime(APIModel):
    """A runtime: conventions a platform team writes once and RLHFJobs name (spec.runtimeRef)."""

    api_version: Literal["rlhf.dev/v1alpha1"] = API_VERSION
    kind: RuntimeKind = RUNTIME_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLHFRuntimeSpec = section(RLHFRuntimeSpec)
