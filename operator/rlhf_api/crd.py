"""Generate the RLHFJob CustomResourceDefinition from the API models (`rlhf crd`, crds/).

Pydantic's JSON schema becomes a structural OpenAPI v3 schema: references inlined, optional
fields as plain types, JSON-Schema-2020 exclusive bounds in their OpenAPI 3.0 form, titles dropped.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter

from . import v1alpha1 as api
from .v1alpha1 import runtime

CEL = "x-kubernetes-validations"
PRINTER_COLUMNS = [
    {"name": "Algorithm", "type": "string", "jsonPath": ".spec.algorithm"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary", "description": "steps done / planned"},
    {"name": "Reward", "type": "number", "format": "float", "jsonPath": ".status.metrics.rewardMean"},
    {"name": "KL", "type": "number", "format": "float", "jsonPath": ".status.metrics.kl", "priority": 1},
    {"name": "GPU-Hours", "type": "number", "format": "float", "jsonPath": ".status.usage.gpuHours",
     "description": "GPU-hours held by the job's pods so far"},
    {"name": "Ray Job", "type": "string", "jsonPath": ".status.rayJobName", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        # A field's own description and extras win over those of the model it refers to.
        target = _structural(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        own = _structural({k: v for k, v in node.items() if k != "$ref"}, defs)
        rules = target.get(CEL, []) + own.get(CEL, [])
        return {**target, **own, **({CEL: rules} if rules else {})}
    any_of = node.get("anyOf")
    if any_of is not None:
        non_null = [option for option in any_of if option.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"only Optional[X] unions map to a structural schema, got {any_of}")
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "default") or (k == "default" and v is not None)}
        return _structural({**non_null[0], **rest}, defs)

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound], out[key] = value, True
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "additionalProperties" and value is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)  # closed objects: unknown fields are pruned or refused
    return out


def _submodels(annotation: Any, node: dict[str, Any]) -> list[tuple[type[BaseModel], dict[str, Any]]]:
    """The API models inside a field's type, each with the schema node it became."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, node)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [found for arg in args if arg is not type(None) for found in _submodels(arg, node)]
    if origin is list:
        return _submodels(args[0], node.get("items", {}))
    if origin is dict and isinstance(node.get("additionalProperties"), dict):
        return _submodels(args[1], node["additionalProperties"])
    return []


def _with_model_defaults(model: type[BaseModel], schema: dict[str, Any]) -> None:
    """Every field's `default:` is what the model gives when the field is absent, whole (a section's
    nested defaults included: the API server checks a default against the CEL rules as it is), so the
    API server and the models default a job alike. Unset-means-None fields get no default."""
    for name, field in model.model_fields.items():
        node = schema["properties"][field.alias or name]
        if not field.is_required():
            value = field.get_default(call_default_factory=True)
            if value is not None:
                node["default"] = TypeAdapter(field.annotation).dump_python(
                    value, mode="json", by_alias=True, exclude_none=True)
        for submodel, subschema in _submodels(field.annotation, node):
            _with_model_defaults(submodel, subschema)


def openapi_schema(model: type[BaseModel], defaults: bool = True) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    if defaults:
        _with_model_defaults(model, schema)
    return schema


def custom_resource_definition() -> dict[str, Any]:
    # No defaults in status: it is what the operator and the trainer wrote, and a default would be
    # added to every partial write (a trainer's progress patch would gain `conditions: []`).
    return _definition(api.KIND, api.PLURAL, "Namespaced", api.RLHFJob.__doc__, {
        "spec": openapi_schema(api.RLHFJobSpec), "status": openapi_schema(api.RLHFJobStatus, defaults=False)},
        PRINTER_COLUMNS, short_names=["rlhf"], rules=api.OBJECT_RULES, status=True)


def runtime_definition(kind: str) -> dict[str, Any]:
    """The CRD of RLHFRuntime (namespaced) or ClusterRLHFRuntime (cluster-scoped): one schema for both."""
    scope = "Cluster" if kind == runtime.CLUSTER_RUNTIME_KIND else "Namespaced"
    columns = [{"name": "Default", "type": "boolean", "jsonPath": ".spec.default"},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return _definition(kind, f"{kind.lower()}s", scope, runtime.RLHFRuntime.__doc__,
                       {"spec": openapi_schema(runtime.RLHFRuntimeSpec)}, columns)


DEFINITIONS = {api.KIND: custom_resource_definition, runtime.RUNTIME_KIND: lambda: runtime_definition(
    runtime.RUNTIME_KIND), runtime.CLUSTER_RUNTIME_KIND: lambda: runtime_definition(runtime.CLUSTER_RUNTIME_KIND)}


def _definition(kind: str, plural: str, scope: str, description: str, properties: dict[str, Any],
                columns: list[dict[str, Any]], *, short_names: list[str] | None = None,
                rules: list[dict[str, Any]] | None = None, status: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                **({"shortNames": short_names} if short_names else {}),
                "categories": ["rlhf", "ml"],
            },
            "scope": scope,
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                **({"subresources": {"status": {}}} if status else {}),
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": description,
                    **({"required": ["spec"]} if status else {}),
                    **({CEL: rules} if rules else {}),
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        **properties,
                    },
                }},
            }],
        },
    }


def render(kind: str = api.KIND) -> str:
    header = "# Generated from operator/rlhf_api/v1alpha1/ by `rlhf crd`. Do not edit.\n"
    return header + yaml.safe_dump(DEFINITIONS[kind](), sort_keys=False, width=120)
