"""Deterministic names and labels of an RLHFJob's children.

Children are found again by name after a restart, so a name depends only on the job's name.
Names that would break a limit are shortened to a prefix plus a stable hash of the full name,
so two long names that share a prefix still get different children.
"""

from __future__ import annotations

import hashlib
import re

# KubeRay appends "-" and 5 characters to a RayJob's name for its RayCluster, whose name must
# stay within 53 (it becomes a label value and a Service name): RayJob names are at most 47.
RAY_JOB_NAME_MAX = 47
OBJECT_NAME_MAX = 253  # DNS subdomain: ConfigMap, ServiceAccount, Role, RoleBinding
LABEL_VALUE_MAX = 63
HASH_LENGTH = 8

MANAGED_BY = "rlhf-operator"
JOB_LABEL = "rlhf.dev/job"
ROLE_LABEL = "rlhf.dev/role"  # on pods: head, worker or submitter
JOB_ANNOTATION = "rlhf.dev/job-name"  # on pod templates: the full name (the label may be shortened)
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # a GPU node's product, as GPU feature discovery labels it


def _hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:HASH_LENGTH]


def _fit(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    return f"{name[:limit - HASH_LENGTH - 1].rstrip('-.')}-{_hash(name)}"


def ray_job(job_name: str) -> str:
    """A DNS-1035 label of at most 47 characters (KubeRay refuses anything else).

    RLHFJob names are DNS subdomains: they may contain dots and start with a digit.
    """
    label = re.sub(r"[^a-z0-9-]", "-", job_name)
    if not label[0].isalpha():
        label = f"rlhf-{label}"
    if label == job_name and len(label) <= RAY_JOB_NAME_MAX:
        return label
    # Any rewrite could collide with another job's name: the hash of the original tells them apart.
    return f"{label[:RAY_JOB_NAME_MAX - HASH_LENGTH - 1].rstrip('-')}-{_hash(job_name)}"


def config_map(job_name: str) -> str:
    return _fit(f"{job_name}-config", OBJECT_NAME_MAX)


def trainer(job_name: str) -> str:
    """The per-job ServiceAccount, and the Role and RoleBinding that give it rights on its job."""
    return _fit(f"{job_name}-trainer", OBJECT_NAME_MAX)


def label_value(job_name: str) -> str:
    """The job's name as a label value (at most 63 characters, alphanumeric at both ends)."""
    return _fit(job_name, LABEL_VALUE_MAX)


def pod_metadata(job_name: str, role: str) -> dict[str, dict[str, str]]:
    """Metadata of a Ray pod template: the job's labels, the pod's role, and the job's full name."""
    return {"labels": {**labels(job_name), ROLE_LABEL: role}, "annotations": {JOB_ANNOTATION: job_name}}


def labels(job_name: str) -> dict[str, str]:
    """Labels every child carries: who manages it and which job it belongs to."""
    return {LABEL_MANAGED_BY: MANAGED_BY, JOB_LABEL: label_value(job_name)}
