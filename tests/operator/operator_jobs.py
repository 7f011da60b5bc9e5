"""RLHFJobs as the operator sees them, for the operator's unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rlhf_api import v1alpha1 as api
from rlhf_api.validation import validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
NAMESPACE = "ml-team"
UID = "6b1c6c2e-0000-4000-8000-000000000001"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "examples" / name).read_text())


def as_job(doc: dict[str, Any], namespace: str = NAMESPACE, uid: str = UID) -> api.RLHFJob:
    """The validated job with the identity the API server would have given it."""
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": doc["metadata"]["name"], "namespace": namespace, "uid": uid}
    return validate(doc)


def tiny(**spec: Any) -> dict[str, Any]:
    """A minimal valid sft job with spec overrides (top-level keys replace, resources merge)."""
    doc = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "tiny"},
        "spec": {
            "algorithm": "sft",
            "models": {"actor": {"path": "org/model"}},
            "data": {"sft": {"sources": [{"path": "org/data"}]}},
        },
    }
    resources = spec.pop("resources", {})
    doc["spec"].update(spec)
    doc["spec"]["resources"] = resources
    return doc
