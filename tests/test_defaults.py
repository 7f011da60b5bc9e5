"""One source of every default: the CRD's `default:`s (what the API server fills in) against the
models' defaults (what `rlhf validate`, `rlhf run` and the operator fill in), field by field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from rlhf_api import v1alpha1 as api
from rlhf_api.crd import _submodels
from rlhf_api.v1alpha1.job import ALGORITHM_DEFAULTS
from rlhf_api.validation import validate

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "rlhf.dev_rlhfjobs.yaml"
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def model_fields(model: type[BaseModel], schema: dict[str, Any], path: str):
    """(path, field, schema node) of every field of model and of the models inside it."""
    for name, field in model.model_fields.items():
        node = schema["properties"][field.alias or name]
        yield f"{path}.{field.alias or name}", field, node
        for submodel, subschema in _submodels(field.annotation, node):
            yield from model_fields(submodel, subschema, f"{path}.{field.alias or name}")


FIELDS = list(model_fields(api.RLHFJobSpec, spec_schema(), "spec"))


@pytest.mark.parametrize("path,field,node", FIELDS, ids=[f[0] for f in FIELDS])
def test_the_crd_default_of_every_field_is_the_model_s(path, field, node):
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if default is None:
        assert "default" not in node, f"{path}: the models leave it unset, the API server sets {node['default']!r}"
    else:
        dumped = TypeAdapter(field.annotation).dump_python(default, mode="json", by_alias=True, exclude_none=True)
        assert node.get("default") == dumped, f"{path}: the models give {dumped!r}, the API server {node.get('default')!r}"


def server_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """What the API server's structural defaulting does: an absent field takes its default, and
    defaults apply again inside every object, defaults included."""
    if isinstance(value, dict) and "properties" in schema:
        value = dict(value)
        for name, prop in schema["properties"].items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = server_defaults(value[name], prop)
    elif isinstance(value, list) and "items" in schema:
        value = [server_defaults(item, schema["items"]) for item in value]
    return value


def model_defaults(manifest: dict[str, Any]) -> dict[str, Any]:
    spec = validate(manifest).spec.model_dump(by_alias=True, exclude_none=True)
    for section, name in ALGORITHM_DEFAULTS:  # no CRD default: the chart's algorithm-defaults policy sets them
        if (manifest["spec"].get(section) or {}).get(name) is None:
            spec[section].pop(name)
    return spec


def manifests() -> list[dict[str, Any]]:
    return [d for p in EXAMPLES for d in yaml.safe_load_all(p.read_text()) if isinstance(d, dict) and d.get("kind") == "RLHFJob"]


@pytest.mark.parametrize("manifest", manifests(), ids=lambda m: m["metadata"]["name"])
def test_the_api_server_and_the_models_default_every_example_alike(manifest):
    assert server_defaults(manifest["spec"], spec_schema()) == model_defaults(manifest)


def test_empty_sections_take_the_model_defaults_on_both_sides():
    """A section written as {} is defaulted inside; resources.head is the head's own 4 CPUs / 16Gi on
    both sides (with PodResources' 8 / 32Gi the server gave an absent head what the models did not)."""
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    spec = manifest["spec"]
    spec["resources"] = {"head": {}, "worker": {}, "gpus": {}}
    spec["training"] = {"kl": {}, "preference": {}}
    spec["checkpoint"] = {}
    spec["models"]["actor"]["lora"] = {}
    spec["rollout"] = {"samplesPerPrompt": 8}
    server = server_defaults(spec, spec_schema())
    assert server == model_defaults(manifest)
    assert server["resources"]["head"] == {"cpu": "4", "memory": "16Gi"}
    assert server["resources"]["worker"] == {"cpu": "8"}  # memory unset: derived from shmSize and the GPUs
    assert server["models"]["actor"]["lora"]["targetModules"] == ["all-linear"]


def test_a_whole_section_default_passes_the_section_s_own_rules():
    """The API server checks each default against the CEL rules as it stands, so a section's
    default is whole, not {} (training's rules read microTrainBatchSize and trainBatchSize)."""
    training = spec_schema()["properties"]["training"]
    assert training["default"]["microTrainBatchSize"] <= training["default"]["trainBatchSize"]
    assert training["default"]["kl"] == {"coef": 0.001, "estimator": "k1", "placement": "reward"}
