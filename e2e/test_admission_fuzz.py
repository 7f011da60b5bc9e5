"""Differential admission fuzzing: `rlhf validate` and the real API server must agree on every
RLHFJob, and default an accepted one alike.

A seeded generator mutates the valid examples (manifests/examples/*.yaml), guided by the CRD's
schema: wrong types, out-of-bounds values, bad enum strings, nulls, removed (required) fields,
unknown fields, and valid values and added sections, one to three at a time, so the CEL rules
across fields are exercised too. Each spec goes to the offline validator and to a server-side dry
run (fieldValidation=Strict) over one keep-alive connection. Both verdicts must agree, and for an
accepted spec the API server's defaulted spec must equal the models' defaulted dump (what the
operator writes into the trainer's config).

RLHF_FUZZ_SEED picks the seed (printed; default 16), RLHF_FUZZ_SPECS the count (default 1000).
"""

from __future__ import annotations

import copy
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.client import Session
from e2e.fixtures import example_jobs
from rlhf_api import algorithms
from rlhf_api.v1alpha1.base import WHOLE_FLOAT_LIMIT
from rlhf_api.validation import InvalidJob, validate

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "rlhf.dev_rlhfjobs.yaml"
EXAMPLES = example_jobs()
SEED = int(os.environ.get("RLHF_FUZZ_SEED", "16"))
SPECS = int(os.environ.get("RLHF_FUZZ_SPECS", "1000"))
INT64_MAX = 2**63 - 1

Path_ = tuple[Any, ...]  # keys and list indices below spec


REMOVED = "<removed>"
Op = tuple[str, Path_, Any]  # (kind of mutation, path, new value or REMOVED)


@dataclass
class Case:
    seed: dict[str, Any]  # the example it started from
    ops: list[Op] = field(default_factory=list)

    def body(self, ops: list[Op] | None = None) -> dict[str, Any]:
        body = copy.deepcopy(self.seed)
        for op in self.ops if ops is None else ops:
            apply(body["spec"], op)
        return body

    def describe(self, ops: list[Op]) -> str:
        return f"{self.seed['metadata']['name']}: " + ", ".join(f"{kind} {show(path)}" + ("" if value == REMOVED else f" = {value!r}"[:120])
                         for kind, path, value in ops)


# ------------------------------------------------------------------------------------ generator


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def examples() -> list[dict[str, Any]]:
    docs = [d for p in EXAMPLES for d in yaml.safe_load_all(p.read_text())
            if isinstance(d, dict) and d.get("kind") == "RLHFJob"]
    for doc in docs:
        doc["metadata"] = {"name": doc["metadata"]["name"]}
    return docs


def show(path: Path_) -> str:
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def targets(value: Any, schema: dict[str, Any], path: Path_ = ()) -> list[tuple[Path_, dict[str, Any], bool]]:
    """(path, schema, present) of every field of the spec, and of every absent field of a present object."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            found.append((path + (name,), child, name in value))
            if name in value:
                found += targets(value[name], child, path + (name,))
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name in value:
            found.append((path + (name,), schema["additionalProperties"], True))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found.append((path + (index,), schema["items"], True))
            found += targets(item, schema["items"], path + (index,))
    return found


def bounds(schema: dict[str, Any]) -> tuple[float, float]:
    low = schema.get("minimum", -1000 if schema["type"] == "number" else -(2**31))
    high = schema.get("maximum", 1000)
    return low, high


def valid(schema: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """A value of the schema's type within its bounds (not always valid: patterns and CEL rules are
    not solved, which the verdicts then must agree on)."""
    kind = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind in ("integer", "number"):
        low, high = bounds(schema)
        low, high = max(low, -64), min(high, max(low, -64) + 128)
        if kind == "integer":
            return rng.randint(int(low) + bool(schema.get("exclusiveMinimum")), int(high) - bool(schema.get("exclusiveMaximum")))
        return rng.choice([round(rng.uniform(low, high), 3), int(high), float(int(low) + 1)])
    if kind == "string":
        fitting = [s for s in STRINGS if re.search(schema.get("pattern", ""), s)]
        return rng.choice(fitting or STRINGS)[: schema.get("maxLength", 64)]
    if kind == "array":
        return [valid(schema["items"], rng, depth + 1) for _ in range(max(1, schema.get("minItems", 0)))]
    if kind == "object" and "properties" in schema and depth < 4:
        props = schema["properties"]
        chosen = set(schema.get("required", [])) | {n for n in props if rng.random() < 0.15}
        return {n: valid(props[n], rng, depth + 1) for n in props if n in chosen}
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return {"key": valid(schema["additionalProperties"], rng, depth + 1)}
    if schema.get("x-kubernetes-preserve-unknown-fields"):  # kept as sent: any JSON inside
        return {"key": rng.choice(["v", 1, 2**70, 1.5, None, True, {"nested": None}])}
    return {}


# Values for strings, some of which fit each pattern of the schema (names, entrypoints, URLs, quantities...).
STRINGS = ["a", "abc", "x-1", "team.a", "mod.py:fn", "pkg.mod:score", "https://h.example/v1", "file:/runs",
           "8", "16Gi", "500m", "Fix", "a/mean_reward", "HF_TOKEN", "eval-1/pass@k"]
WRONG_TYPES = {
    "integer": [True, False, "1", "4", 1.5, 2.0, -3.0, 1e15, 1e21, INT64_MAX, INT64_MAX + 1, -(2**63) - 1, [], {}, ""],
    "number": [True, "0.5", "1", 1, 0, 2**70, [], {}],
    "boolean": [1, 0, "true", "false", "yes", "True", [], {}],
    "string": [1, 8, True, 1.5, [], {}, ""],
    "object": ["x", 1, True, [], [{}]],
    "array": ["x", 1, {}, [None]],
}


def wrong_type(schema: dict[str, Any], rng: random.Random) -> Any:
    return rng.choice(WRONG_TYPES.get(schema.get("type"), ["x", 1]))


def out_of_bounds(schema: dict[str, Any], rng: random.Random) -> Any:
    kind, choices = schema.get("type"), []
    if kind in ("integer", "number"):
        step = 1 if kind == "integer" else rng.choice([1, 0.5, 1e-9])
        if "minimum" in schema:
            choices += [schema["minimum"], schema["minimum"] - step]
        if "maximum" in schema:
            choices += [schema["maximum"], schema["maximum"] + step]
        elif kind == "integer":  # int64's end: products in CEL rules overflow
            choices += [INT64_MAX]
    elif kind == "string":
        choices += [""] + (["a" * schema["maxLength"], "a" * (schema["maxLength"] + 1)] if "maxLength" in schema else [])
    elif kind == "array":
        item = valid(schema["items"], rng, 3)
        choices += [[]] + ([[copy.deepcopy(item) for _ in range(schema["maxItems"] + 1)]] if "maxItems" in schema else [])
    return rng.choice(choices) if choices else wrong_type(schema, rng)


def bad_enum(schema: dict[str, Any], rng: random.Random) -> Any:
    if "enum" not in schema:
        return out_of_bounds(schema, rng)
    first = schema["enum"][0]
    if isinstance(first, str):
        return rng.choice([first.upper(), first.title(), first + " ", "x", first.replace("-", "_"), ""])
    return rng.choice([max(schema["enum"]) + 1, min(schema["enum"]) - 1, str(first)])


def unknown_name(schema: dict[str, Any], rng: random.Random) -> str:
    known = list(schema.get("properties", {})) or ["field"]
    name = rng.choice(known)
    return rng.choice([
        "".join(f"_{c.lower()}" if c.isupper() else c for c in name),  # snake_case of a camelCase field
        name[:1].upper() + name[1:],
        name + "s",
        "unknownField",
    ])


def parent_of(spec: dict[str, Any], path: Path_) -> Any:
    node = spec
    for part in path[:-1]:
        node = node[part]
    return node


def cel_names(schema: dict[str, Any]) -> set[str]:
    """Field names the CEL rules anywhere in the schema read."""
    names = {n for rule in schema.get("x-kubernetes-validations", []) for n in re.findall(r"\.([A-Za-z]\w*)", rule["rule"])}
    children = list(schema.get("properties", {}).values()) + [schema[k] for k in ("items", "additionalProperties")
                                                             if isinstance(schema.get(k), dict)]
    return names.union(*(cel_names(c) for c in children))


# Which fields each kind of mutation applies to (others apply to any field).
FITS = {
    "remove": lambda node, present: present,
    "bounds": lambda node, present: bool({"minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems"} & node.keys()),
    "enum": lambda node, present: "enum" in node,
}


def apply(spec: dict[str, Any], op: Op) -> None:
    _, path, value = op
    parent = parent_of(spec, path)
    if value == REMOVED:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)


def mutate(spec: dict[str, Any], schema: dict[str, Any], rng: random.Random) -> Op:
    fields = targets(spec, schema)
    kind = rng.choice(["valid", "wrong-type", "bounds", "enum", "null", "unknown", "remove", "cel", "cel"])
    if kind == "cel":  # a valid value (or none) for a field some CEL rule reads: combinations across fields
        read = cel_names(schema)
        path, node, present = rng.choice([f for f in fields if f[0][-1] in read])
        if present and rng.random() < 0.25:
            return "cel-remove", path, REMOVED
        return kind, path, valid(node, rng)
    if kind == "unknown":  # into the spec or one of its objects
        objects = [((), schema)] + [(p, n) for p, n, present in fields if present and "properties" in n
                                    and isinstance(parent_of(spec, p)[p[-1]], dict)]
        path, node = rng.choice(objects)
        return kind, path + (unknown_name(node, rng),), valid({"type": rng.choice(["string", "integer", "boolean"])}, rng)
    fits = FITS.get(kind, lambda node, present: True)
    path, node, present = rng.choice([f for f in fields if fits(f[1], f[2])])
    return kind, path, {
        "remove": lambda: REMOVED,
        "valid": lambda: valid(node, rng),
        "wrong-type": lambda: wrong_type(node, rng),
        "bounds": lambda: out_of_bounds(node, rng),
        "enum": lambda: bad_enum(node, rng),
        "null": lambda: None,
    }[kind]()


def generate(rng: random.Random, count: int) -> list[Case]:
    schema, seeds = spec_schema(), examples()
    cases = []
    for _ in range(count):
        case = Case(rng.choice(seeds))
        body = case.body()
        for _ in range(rng.choice([1, 1, 2, 3])):
            op = mutate(body["spec"], schema, rng)
            apply(body["spec"], op)
            case.ops.append(op)
        cases.append(case)
    return cases


# ------------------------------------------------------------------------------------ verdicts


def as_kubectl_sends(value: Any) -> Any:
    """The body kubectl (or Helm, Argo CD) would send for this YAML: Go's JSON encoder writes a whole
    float64 below 1e21 as an integer."""
    if isinstance(value, dict):
        return {k: as_kubectl_sends(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_kubectl_sends(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < WHOLE_FLOAT_LIMIT:
        return int(value)
    return value


def offline(body: dict[str, Any]) -> tuple[bool, Any]:
    """(accepted, the defaulted spec as the operator writes it, or the errors)."""
    try:
        job = validate(copy.deepcopy(body))
    except InvalidJob as refused:
        return False, [str(e) for e in refused.errors]
    # The per-algorithm defaults too: the chart's algorithm-defaults policy has the API server store them.
    return True, job.spec.model_dump(by_alias=True, exclude_none=True)


def differences(ours: Any, theirs: Any, path: str = "spec") -> list[str]:
    """Where two JSON values differ; numbers compare by value (1 == 1.0), but a boolean is not a number."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [d for k in sorted(ours.keys() | theirs.keys())
                for d in differences(ours.get(k, "<absent>"), theirs.get(k, "<absent>"), f"{path}.{k}")]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(ours, bool) != isinstance(theirs, bool) or ours != theirs:
        return [f"{path}: models {ours!r}, API server {theirs!r}"]
    return []


@pytest.fixture(scope="module")
def api_server(control_plane, fuzz_namespace) -> Any:
    error = control_plane.crd_errors.get(str(CRD))
    if error:
        pytest.fail(f"the API server refused {CRD.relative_to(REPO)}:\n{error}", pytrace=False)
    session = Session(control_plane.server, control_plane.token, control_plane.pki / "ca.crt")
    yield session, fuzz_namespace
    session.close()


@pytest.fixture(scope="module")
def fuzz_namespace(kube_api) -> Any:
    from kubernetes import client

    name = f"e2e-admission-fuzz-{random.randrange(16**6):06x}"
    kube_api.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    kube_api.core.delete_namespace(name)


def compare(session: Session, url: str, body: dict[str, Any]) -> tuple[bool, str | None]:
    """(whether the API server accepted body, how `rlhf validate` disagrees with it or None)."""
    ours_ok, ours = offline(body)
    status, answer = session.request("POST", url, as_kubectl_sends(body))
    assert status in (201, 400, 422), f"API server answered {status}: {answer}"
    theirs_ok = status == 201
    if ours_ok != theirs_ok:
        ours_says = "accepted" if ours_ok else f"refused: {'; '.join(ours)}"
        theirs_says = "accepted" if theirs_ok else f"refused: {answer.get('message', '')}"
        return theirs_ok, f"rlhf validate {ours_says[:300]}\n      API server {theirs_says[:300]}"
    diff = differences(ours, answer["spec"]) if ours_ok else []
    return theirs_ok, ("defaults differ: " + "; ".join(diff[:8])) if diff else None


def test_validate_and_the_api_server_agree_on_mutated_specs(api_server) -> None:
    session, namespace = api_server
    print(f"\nadmission fuzz: RLHF_FUZZ_SEED={SEED} RLHF_FUZZ_SPECS={SPECS}")
    cases = generate(random.Random(SEED), SPECS)
    url = f"/apis/rlhf.dev/v1alpha1/namespaces/{namespace}/rlhfjobs?dryRun=All&fieldValidation=Strict"
    disagreements, accepted, started = [], 0, time.monotonic()
    for case in cases:
        ok, problem = compare(session, url, case.body())
        accepted += ok
        if problem:
            # Minimal: the first single mutation that disagrees by itself, else all of them.
            for op in case.ops if len(case.ops) > 1 else []:
                try:
                    alone = compare(session, url, case.body([op]))[1]
                except (KeyError, IndexError, TypeError):  # it needed an earlier mutation
                    continue
                if alone:
                    disagreements.append(f"{case.describe([op])}\n      {alone}")
                    break
            else:
                disagreements.append(f"{case.describe(case.ops)}\n      {problem}")
    elapsed = time.monotonic() - started
    print(f"admission fuzz: {len(cases)} specs in {elapsed:.1f}s: {accepted} accepted, "
          f"{len(cases) - accepted} refused by the API server; {len(disagreements)} disagreements")
    # Both verdicts are exercised: a generator whose specs all fail (or all pass) early would test little.
    assert 0.1 * len(cases) < accepted < 0.9 * len(cases), f"{accepted} of {len(cases)} accepted"
    assert not disagreements, (f"{len(disagreements)} of {len(cases)} specs (RLHF_FUZZ_SEED={SEED}) disagree "
                               f"(example: mutations; verdicts):\n  "
                               + "\n  ".join(disagreements[:40]))


@pytest.mark.parametrize("algorithm", algorithms.ONLINE)
def test_the_stored_job_shows_the_training_its_algorithm_runs_with(api_server, algorithm) -> None:
    """Each online algorithm of the catalogue, its training section left to the defaults: the job the
    API server stores (what `kubectl get -o yaml` shows) has the algorithm's clip range and loss
    aggregation, the values `rlhf validate` and the trainer use."""
    session, namespace = api_server
    body = next(e for e in examples() if e["metadata"]["name"] == "tiny-grpo-cpu")
    body["spec"]["algorithm"] = algorithm
    spec = body["spec"]
    # One optimizer step per rollout (what online-dpo asks, valid for every algorithm), and distill's teacher.
    spec["training"]["trainBatchSize"] = spec["training"]["rolloutBatchSize"] * spec["rollout"]["samplesPerPrompt"]
    if algorithm in algorithms.USES_TEACHER:
        spec["models"]["teacher"] = dict(spec["models"]["actor"])
    for name in algorithms.TRAINING_DEFAULTS:
        body["spec"]["training"].pop(name, None)
    url = f"/apis/rlhf.dev/v1alpha1/namespaces/{namespace}/rlhfjobs?dryRun=All&fieldValidation=Strict"
    status, answer = session.request("POST", url, as_kubectl_sends(body))
    assert status == 201, answer
    stored = {name: answer["spec"]["training"].get(name, "<absent>") for name in algorithms.TRAINING_DEFAULTS}
    assert stored == algorithms.ALGORITHMS[algorithm].training_defaults
