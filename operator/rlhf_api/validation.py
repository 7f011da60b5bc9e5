"""The checks an RLHFJob must pass, runnable without a cluster (`rlhf validate`, the trainer).

Two layers, in the order the API server applies them: the schema (the pydantic models the CRD is
generated from, with their defaults), then the CRD's own CEL rules evaluated on the defaulted
object. The rules are read from the generated CRD, so there is one copy of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import celpy
from pydantic import ValidationError

from . import v1alpha1 as api
from .crd import CEL, openapi_schema


@dataclass(frozen=True)
class FieldError:
    path: str  # e.g. spec.rollout.samplesPerPrompt
    message: str  # what is wrong and what to change

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class InvalidJob(ValueError):
    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("invalid RLHFJob:\n" + "\n".join(f"  {e}" for e in errors))


_HINTS = {
    "extra_forbidden": "unknown field: remove it or fix its spelling (`rlhf crd` or `kubectl explain rlhfjob.spec` lists the fields)",
    "missing": "required field is missing",
}


def _path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _description(loc: tuple[Any, ...]) -> str:
    node = openapi_schema(api.RLHFJob)
    for part in loc:
        node = node.get("items", {}) if isinstance(part, int) else node.get("properties", {}).get(part, {})
    return node.get("description", "")


def _schema_errors(error: ValidationError) -> list[FieldError]:
    errors = []
    for e in error.errors():
        message = _HINTS.get(e["type"], e["msg"])
        if e["type"] == "string_pattern_mismatch":
            message = f"{e['input']!r} has the wrong form; expected: {_description(e['loc'])}"
        errors.append(FieldError(_path(e["loc"]), message))
    return errors


@lru_cache(maxsize=1)
def _cel_env() -> celpy.Environment:
    return celpy.Environment()


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    env = _cel_env()
    return env.program(env.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    """Evaluate the schema's CEL rules on value and everything below it, as the API server does on create."""
    errors = []
    for rule in schema.get(CEL, []):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules only apply to updates
        if not bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})):
            errors.append(FieldError(path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for name, child in value.items():
            if name in schema.get("properties", {}):
                errors += cel_errors(schema["properties"][name], child, f"{path}.{name}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


@lru_cache(maxsize=1)
def _spec_schema() -> dict[str, Any]:
    return openapi_schema(api.RLHFJobSpec)


def validate(obj: dict[str, Any]) -> api.RLHFJob:
    """Parse an RLHFJob manifest with defaults applied, or raise InvalidJob listing every problem."""
    if not isinstance(obj, dict):
        raise InvalidJob([FieldError("(document)", "expected a YAML mapping with apiVersion, kind, metadata and spec")])
    if obj.get("apiVersion") != api.API_VERSION or obj.get("kind") != api.KIND:
        raise InvalidJob([FieldError(
            "apiVersion/kind", f"expected apiVersion: {api.API_VERSION} and kind: {api.KIND}, "
            f"got {obj.get('apiVersion')!r} / {obj.get('kind')!r}")])
    try:
        job = api.RLHFJob.model_validate(obj)
    except ValidationError as error:
        raise InvalidJob(_schema_errors(error)) from None
    spec = job.spec.model_dump(by_alias=True, exclude_none=True)
    errors = cel_errors(_spec_schema(), spec, "spec")
    if errors:
        raise InvalidJob(errors)
    return job
