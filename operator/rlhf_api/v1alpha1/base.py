"""What every API type shares: the group and kind, the base model, CEL and default helpers."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"

Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$", max_length=32)]
# Kubernetes objects we pass through untouched (tolerations, affinity, envFrom entries...).
Passthrough = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
DateTime = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Model config carrying CEL rules: (rule, message[, fieldPath relative to this object])."""
    validations = []
    for rule, message, *field_path in rules:
        entry = {"rule": rule, "message": message}
        if field_path:
            entry["fieldPath"] = field_path[0]
        validations.append(entry)
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": validations})


def section(model: type[BaseModel]) -> Any:
    """An optional sub-object whose own fields all have defaults: absent means all defaults."""
    return Field(default_factory=model, json_schema_extra={"default": {}})


def immutable(what: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{
        "rule": "self == oldSelf",
        "message": f"spec.{what} defines the run and is immutable; create a new RLHFJob instead",
    }]}


class APIModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True,
    )
