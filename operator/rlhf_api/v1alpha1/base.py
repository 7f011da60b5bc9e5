"""What every API type shares: the group and kind, the base model, CEL and default helpers."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError
from pydantic.alias_generators import to_camel

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"

Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$", max_length=32)]
_QUANTITY_SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def quantity_bytes(quantity: str) -> int:
    """A Quantity (the pattern above) as a number: 16Gi -> 17179869184."""
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return int(float(number) * _QUANTITY_SUFFIXES[suffix])


# Kubernetes objects we pass through untouched (tolerations, affinity, envFrom entries...).
Passthrough = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
DateTime = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]

# Names of Kubernetes objects (Kubernetes' own validation rules). A reference to another object must
# be one: the operator joins it into an API path, where "../../kube-system/configmaps/x" would reach
# another namespace's object.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # at most 63
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # at most 253
# ConfigMap, Secret, PersistentVolumeClaim, PriorityClass.
ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]


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
    """An optional sub-object whose own fields all have defaults: absent means all defaults (the CRD's
    default is generated from the model, as for every field: crd.py)."""
    return Field(default_factory=model)


def immutable(what: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{
        "rule": "self == oldSelf",
        "message": f"spec.{what} defines the run and is immutable; create a new RLHFJob instead",
    }]}


# The API server holds an integer as an int64.
INT64 = range(-(2**63), 2**63)
# Go's JSON encoder writes a whole float64 below 1e21 as an integer (2.0 as 2), and kubectl, Helm and
# Argo CD send YAML through it: a whole YAML float reaches the API server as an integer.
WHOLE_FLOAT_LIMIT = 1e21


class APIModel(BaseModel):
    # strict: types as the CRD's structural schema checks them (no "true" or 1 for a boolean, no true
    # or "1" for an integer; a number takes an integer), not as pydantic would coerce them.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True,
        strict=True,
    )

    @field_validator("*", mode="wrap")
    @classmethod
    def _numbers_as_the_api_server_reads_them(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, float) and value.is_integer() and abs(value) < WHOLE_FLOAT_LIMIT:
            try:
                return handler(value)  # a number field keeps the float
            except ValueError:
                value = int(value)  # an integer field reads it as kubectl sends it
        result = handler(value)
        if isinstance(value, bool) and not isinstance(result, bool):  # strict mode still lets Literal[0, 1] take True
            raise PydanticCustomError("int_type", "Input should be a valid integer, not a boolean")
        if type(result) is int and result not in INT64:
            raise PydanticCustomError("int_range", "Input should fit in a 64-bit integer (the API server's int64)")
        return result
