"""What only the operator can judge about a spec the CRD admitted: can it be realised here?

A check that fails raises Unrealisable with a CamelCase reason and a message that says what to
change; the job then ends Failed instead of leaving pods Pending forever. What may still appear
(a ConfigMap applied after the job: `kubectl apply -f dir/` goes in name order) raises Waiting,
as a pod waits for its volumes, and becomes Unrealisable only after DEPENDENCY_WAIT_SECONDS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_api import v1alpha1 as api

# Most GPUs one node of a product carries (values of the GFD label nvidia.com/gpu.product).
GPUS_PER_NODE = {
    "NVIDIA-B200": 8,
    "NVIDIA-GB200": 4,
    "NVIDIA-H200": 8,
    "NVIDIA-H100-80GB-HBM3": 8,
    "NVIDIA-H100-NVL": 8,
    "NVIDIA-H100-PCIe": 8,
    "NVIDIA-A100-SXM4-80GB": 8,
    "NVIDIA-A100-SXM4-40GB": 8,
    "NVIDIA-A100-80GB-PCIe": 8,
    "NVIDIA-L40S": 8,
    "NVIDIA-L4": 8,
    "NVIDIA-A10G": 8,
    "Tesla-V100-SXM2-16GB": 8,
    "Tesla-T4": 8,
}


# How long a job waits for what it references (a reward ConfigMap) before it fails; documented in
# docs/concepts/rlhfjob.md. Long enough for GitOps tools to apply a directory, short enough to notice a typo.
DEPENDENCY_WAIT_SECONDS = 600


class Unrealisable(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class Waiting(Unrealisable):
    """Not yet realisable: the job stays Pending with this reason and is checked again."""


def check_gpus(spec: api.RLHFJobSpec) -> None:
    resources = spec.resources
    most = GPUS_PER_NODE.get(resources.gpu_product or "")
    if most is not None and resources.gpus_per_node > most:
        raise Unrealisable(
            "TooManyGPUsPerNode",
            f"spec.resources.gpusPerNode is {resources.gpus_per_node} but a {resources.gpu_product} node has at "
            f"most {most} GPUs: set gpusPerNode to {most} or less and raise spec.resources.nodes instead")


# Access modes under which pods on several nodes may mount a claim at once: the head and every worker
# write the checkpoint and model cache claims, and read a model's (mounted readOnly).
WRITTEN_BY_ALL = ("ReadWriteMany",)
READ_BY_ALL = ("ReadWriteMany", "ReadOnlyMany")
# A job of one node has its head on the worker's node (render._head_scheduling): a claim one node attaches
# will do. Not ReadWriteOncePod: the head and the worker are two pods.
ONE_NODE = "ReadWriteOnce"


def check_claims(spec: api.RLHFJobSpec, claim: Callable[[str], dict[str, Any] | None]) -> None:
    """The head and every worker mount the job's claims, on different nodes unless the job has one: a claim
    they cannot all attach would leave the pods in Multi-Attach errors (or Pending) forever.
    A claim that does not exist yet is the scheduler's to report (the job's status gives its reason)."""
    claims = [(f"spec.models.{role}.pvc", model.pvc.claim_name, READ_BY_ALL)
              for role, model in spec.models if model is not None and model.pvc is not None]
    if spec.checkpoint.pvc:
        claims.append(("spec.checkpoint.pvc", spec.checkpoint.pvc, WRITTEN_BY_ALL))
    if spec.resources.model_cache:
        claims.append(("spec.resources.modelCache.pvc", spec.resources.model_cache.pvc, WRITTEN_BY_ALL))
    workers = spec.resources.nodes
    for field, name, shared in claims:
        found = claim(name)
        if found is None:
            continue
        # Those of the volume it is bound to, else those it asks for.
        modes = (found.get("status") or {}).get("accessModes") or found["spec"].get("accessModes") or []
        usable = shared if workers > 1 else (*shared, ONE_NODE)
        if modes and not set(modes) & set(usable):
            where = (f"the head and {workers} worker pods mount it on different nodes" if workers > 1 else
                     "the head and the worker pod both mount it, on the worker's node")
            raise Unrealisable(
                "VolumeNotShared",
                f"{field}: claim {name} is {', '.join(modes)}: {where}; use a {' or '.join(usable)} claim"
                + (" (NFS, CephFS, Filestore, EFS, Lustre...)" if workers > 1 else ""))


def check_code_config_maps(job: api.RLHFJob, config_map_exists: Callable[[str], bool], waited: float) -> None:
    """The ConfigMaps of reward functions and of the environment; waited: seconds since the job was created."""
    namespace = job.metadata["namespace"]
    for code in job.spec.code_config_maps():
        if config_map_exists(code.name):
            continue
        missing = (f"{code.owner} loads its code from ConfigMap {code.name!r}, which does not exist in "
                   f"namespace {namespace}")
        create = f"kubectl -n {namespace} create configmap {code.name} --from-file=<your .py files>"
        if waited < DEPENDENCY_WAIT_SECONDS:
            raise Waiting(code.missing_reason, f"{missing} yet: waiting up to {DEPENDENCY_WAIT_SECONDS}s "
                          f"after creation for it to appear ({create})")
        raise Unrealisable(code.missing_reason, f"{missing} after {DEPENDENCY_WAIT_SECONDS}s: create it "
                           f"({create}), then delete and re-create this RLHFJob")


def check(job: api.RLHFJob, config_map_exists: Callable[[str], bool],
          claim: Callable[[str], dict[str, Any] | None], waited: float) -> None:
    """Every check, cheapest first and final refusals before waits; raises Unrealisable (or Waiting)
    on the first that fails. claim: a PersistentVolumeClaim of the job's namespace by name, or None."""
    check_gpus(job.spec)
    check_claims(job.spec, claim)
    check_code_config_maps(job, config_map_exists, waited)
