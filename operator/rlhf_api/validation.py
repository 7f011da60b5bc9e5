"""The checks an RLHFJob must pass, runnable without a cluster (`rlhf validate`, the trainer).

Two layers, in the order the API server applies them: the schema (the pydantic models the CRD is
generated from, with their defaults), then the CRD's own CEL rules evaluated on the defaulted
object. The rules are read from the generated CRD, so there is one copy of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import cel
from pydantic import ValidationError

from . import v1alpha1 as api
from .crd import CEL, openapi_schema
from .v1alpha1.base import INT64


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
    # Types are checked as the API server checks them: YAML's quotes and true/false matter.
    "int_type": "expected an integer such as 4 (not true/false, not a quoted \"4\", no fraction): write the number unquoted",
    "float_type": "expected a number such as 0.5 (not true/false, not quoted): write the number unquoted",
    "bool_type": "expected true or false (not 1/0, not a quoted \"true\"): write true or false unquoted",
    "string_type": "expected a string: quote the value (e.g. \"8\" for a quantity)",
    "model_type": "expected an object (a mapping of field: value)",
    "dict_type": "expected an object (a mapping of key: value)",
    "list_type": "expected a list (- item lines, or [a, b])",
}


def _path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


@lru_cache(maxsize=1)
def _job_schema() -> dict[str, Any]:
    return openapi_schema(api.RLHFJob)


def _description(loc: tuple[Any, ...]) -> str:
    node = _job_schema()
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


# What a rule that cannot be evaluated raises (the API server refuses the object then too): an int64
# overflow, a division by zero, a missing key or index, no overload for the operand types.
CEL_EVAL_ERRORS = (ArithmeticError, LookupError, TypeError, RuntimeError)


@lru_cache(maxsize=None)
def _program(rule: str) -> cel.Program:
    # common-expression-language (cel-rust): a compiled rule evaluates in microseconds, where an
    # interpreter over the parse tree took a millisecond; the operator validates every new job.
    return cel.compile(rule)


def cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    """Evaluate the schema's CEL rules on value and everything below it, as the API server does on create."""
    errors = []
    rules = [rule for rule in schema.get(CEL, []) if "oldSelf" not in rule["rule"]]  # transition rules: updates only
    if rules:
        context = cel.Context()  # self converted to CEL values once for all the node's rules, not per rule
        context.add_variable("self", value)
    for rule in rules:
        try:
            holds = bool(_program(rule["rule"]).execute(context))
        except CEL_EVAL_ERRORS as error:
            errors.append(FieldError(path, f"{rule['message']} (the rule cannot be evaluated: {error})"))
            continue
        if not holds:
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


def as_the_api_server_reads(value: Any, schema: dict[str, Any]) -> Any:
    """value as the API server has it before it defaults and validates: it prunes the nulls of fields
    (none of ours is nullable) and of map values, so a null field is an absent one; unknown fields
    and the objects kept as sent (preserve-unknown-fields) keep theirs. Its JSON decoder reads an
    integer beyond int64 as a float64: the models refuse one for an integer field, and inside kept
    objects it becomes that float (the CEL library, too, holds integers as int64)."""
    if isinstance(value, dict):
        known, values = schema.get("properties"), schema.get("additionalProperties")
        out = {}
        for name, child in value.items():
            # The schema of a field or map value (None: an unknown field, or inside a kept object).
            child_schema = known.get(name) if known is not None else values if isinstance(values, dict) else None
            if child is not None or child_schema is None:
                out[name] = as_the_api_server_reads(child, child_schema or {})
        return out
    if isinstance(value, list):
        return [as_the_api_server_reads(item, schema.get("items", {})) for item in value]
    if type(value) is int and value not in INT64 and "type" not in schema:
        return float(value)
    return value


def validate(obj: dict[str, Any]) -> api.RLHFJob:
    """Parse an RLHFJob manifest with defaults applied, or raise InvalidJob listing every problem."""
    if not isinstance(obj, dict):
        raise InvalidJob([FieldError("(document)", "expected a YAML mapping with apiVersion, kind, metadata and spec")])
    if obj.get("apiVersion") != api.API_VERSION or obj.get("kind") != api.KIND:
        raise InvalidJob([FieldError(
            "apiVersion/kind", f"expected apiVersion: {api.API_VERSION} and kind: {api.KIND}, "
            f"got {obj.get('apiVersion')!r} / {obj.get('kind')!r}")])
    try:
        # by_name=False: a manifest names fields by their camelCase names only, as the API server reads it.
        job = api.RLHFJob.model_validate(as_the_api_server_reads(obj, _job_schema()), by_name=False)
    except ValidationError as error:
        raise InvalidJob(_schema_errors(error)) from None
    spec = job.spec.model_dump(by_alias=True, exclude_none=True)
    errors = cel_errors(_spec_schema(), spec, "spec")
    name = (obj.get("metadata") or {}).get("name")
    whole = {"metadata": {"name": name} if name else {}, "spec": spec}
    errors += [FieldError(e.path.lstrip("."), e.message) for e in cel_errors({CEL: api.OBJECT_RULES}, whole, "")]
    if errors:
        raise InvalidJob(errors)
    return job
