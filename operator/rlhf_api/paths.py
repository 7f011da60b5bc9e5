"""How paths in a job file are read: the one rule for model, dataset and reward-function paths (the trainer's,
and `rlhf validate --gpu`'s when it reads the models' configs)."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_api import contract
from rlhf_api.v1alpha1 import ModelsSpec

# org/name as on the Hugging Face hub (also matches a two-part relative path; see resolve).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def local_path(path: str, base_dir: Path) -> Path:
    """A file path from a job file: relative to base_dir (the job file's directory), absolute kept."""
    return Path(base_dir) / path  # an absolute path replaces base_dir


def is_hub_id(path: str) -> bool:
    """Whether path has the shape of a Hugging Face id (org/name)."""
    return bool(_HUB_ID.match(path))


def resolve(path: str, base_dir: Path) -> str:
    """Where a model or dataset path from a job file points.

    Like local_path, except that a Hugging Face id (org/name) is kept unchanged unless
    base_dir/org/name exists: a local folder wins over the hub.
    """
    local = local_path(path, base_dir)
    if is_hub_id(path) and not local.exists():
        return path
    return str(local)


def model_path(models: ModelsSpec, role: str, base_dir: Path) -> str:
    """Where a model group's weights are: on the PVC the operator mounts (contract.model_on_pvc), or
    resolved from the job file's directory."""
    field, model = models.source(role)
    if model.pvc is not None:
        return contract.model_on_pvc(field, model.path)
    return resolve(model.path, base_dir)
