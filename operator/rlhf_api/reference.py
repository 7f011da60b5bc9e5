"""The RLHFJob API reference as Markdown, generated from the CRD's schema and the algorithm catalogue.

The docs site builds its API reference page from `markdown()` (docs/hooks.py), so the page says
what `kubectl explain` and the API server say: one section per object of spec, a row per field
with its type, default, bounds and description, then the CEL rules that name the field.
"""

from __future__ import annotations

import json
from typing import Any

from . import crd
from .algorithms import CATALOGUE, TRAINING_DEFAULTS

BOUNDS = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "minProperties", "pattern")


def spec_schema() -> dict[str, Any]:
    return crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _type(node: dict[str, Any]) -> str:
    if "items" in node:
        return f"[]{_type(node['items'])}"
    if isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type(node['additionalProperties'])}"
    return node.get("format") or node.get("type") or "any"


def _bounds(node: dict[str, Any]) -> str:
    said = [f"{key} `{node[key]}`" + (" (exclusive)" if node.get(f"exclusive{key.title()}") else "")
            for key in BOUNDS if key in node]
    if "enum" in node:
        said.append("one of " + ", ".join(f"`{value}`" for value in node["enum"]))
    return "; ".join(said)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(node: dict[str, Any]) -> str:
    if "default" not in node or node.get("type") == "object":
        return ""  # an object's default is its fields' defaults, shown on their rows
    return f"`{json.dumps(node['default'])}`"


def _objects(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every object with fields under node, itself first, as (path, schema); list items as path[]."""
    if "items" in node:
        return _objects(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        return _objects(node["additionalProperties"], f"{path}.*")
    if "properties" not in node:
        return []
    found = [(path, node)]
    for name, child in node["properties"].items():
        found += _objects(child, f"{path}.{name}")
    return found


def field_paths() -> list[str]:
    """Every field of spec, as the reference names it (spec.training.kl.coef, spec.reward.sources[].name)."""
    return [f"{path}.{name}" for path, node in _objects(spec_schema(), "spec") for name in node["properties"]]


def _rules(path: str, node: dict[str, Any]) -> list[str]:
    """The object's CEL rules, each under the field it names (fieldPath), else the object itself."""
    return [f"- `{path}{rule.get('fieldPath', '')}`: {rule.get('message') or rule.get('messageExpression')} "
            f"(`{rule['rule']}`)" for rule in node.get(crd.CEL, [])]


def _algorithms() -> list[str]:
    fields = list(TRAINING_DEFAULTS)
    lines = ["## Algorithms", "",
             "`spec.algorithm` picks one of these (`operator/rlhf_api/algorithms.py`). The training fields "
             "in the last columns default per algorithm when the job leaves them unset.", "",
             "| algorithm | trains on | model groups | paper | " + " | ".join(f"`{f}`" for f in fields) + " |",
             "|---" * (4 + len(fields)) + "|"]
    for info in CATALOGUE:
        defaults = info.training_defaults
        lines.append(f"| `{info.name}` | `data.{info.dataset}` | {', '.join(info.roles)} | {_cell(info.paper)} | "
                     + " | ".join(f"`{defaults[f]}`" for f in fields) + " |")
    return lines + [""]


def runtime_spec_schema() -> dict[str, Any]:
    definition = crd.runtime_definition("ClusterRLHFRuntime")
    return definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _tables(schema: dict[str, Any], root: str) -> list[str]:
    """A section per object under schema (its fields' rows, then its rules), paths starting at root."""
    lines = []
    for path, node in _objects(schema, root):
        lines += [f"## `{path}`", "", _cell(node.get("description", "")), "",
                  "| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        required = set(node.get("required", []))
        for name, child in node["properties"].items():
            shown = f"`{name}`" + (" (required)" if name in required else "")
            lines.append(f"| {shown} | `{_type(child)}` | {_default(child)} | {_cell(_bounds(child))} | "
                         f"{_cell(child.get('description', ''))} |")
        rules = _rules(path, node)
        lines += ["", "Rules:", "", *rules, ""] if rules else [""]
    return lines


def markdown() -> str:
    lines = ["# API reference", "",
             "Generated from the API models in `operator/rlhf_api/v1alpha1/` when the site is built: the "
             "descriptions are the CRD's, the ones `kubectl explain rlhfjob.spec` shows. Each CEL rule is "
             "listed under the object that declares it, naming the field it reports on.", ""]
    lines += _algorithms()
    lines += _tables(spec_schema(), "spec")
    lines += ["# Runtimes: RLHFRuntime and ClusterRLHFRuntime", "",
              "One schema for both kinds (`kubectl explain clusterrlhfruntime.spec`); below, `runtime.spec` is "
              "either's spec.", ""]
    lines += _tables(runtime_spec_schema(), "runtime.spec")
    return "\n".join(lines)
