"""The RLHFJob API: the generated CRD, the examples, and `rlhf validate` on invalid specs."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from rlhf_api import crd
from rlhf_api.validation import InvalidJob, validate
from rlhf_operator.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "tests" / "specs" / "invalid").glob("*.yaml"))
CRD_FILE = ROOT / "crds" / "rlhf.dev_rlhfjobs.yaml"


def expectation(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.split(": ", 1)[1]
    raise AssertionError(f"{path.name} has no '# {key}:' line")


def openapi() -> dict:
    return crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_matches_the_api_models():
    assert CRD_FILE.read_text() == crd.render(), "crds/ drifted from the API models: run `rlhf crd > crds/rlhf.dev_rlhfjobs.yaml`"


def walk(schema: dict, path: str = ""):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_every_field_is_documented():
    schema = openapi()
    for path, node in walk(schema["properties"]["spec"], "spec"):
        assert "type" in node, f"{path} has no type"
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title"} & node.keys(), f"{path} is not structural"
        if not path.endswith(("[]", "{}")) or "properties" in node:
            assert node.get("description"), f"{path} has no description for kubectl explain"
        if node["type"] == "object" and "properties" in node:
            assert "additionalProperties" not in node
        assert not isinstance(node.get("exclusiveMinimum"), (int, float)) or isinstance(node["exclusiveMinimum"], bool)


def test_crd_metadata_printer_columns_and_subresource():
    definition = crd.custom_resource_definition()
    version = definition["spec"]["versions"][0]
    assert definition["metadata"]["name"] == "rlhfjobs.rlhf.dev"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Reward"] == ".status.metrics.rewardMean"
    assert "rlhf" in definition["spec"]["names"]["shortNames"]
    training = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["training"]
    rules = [r["rule"] for r in training["x-kubernetes-validations"]]
    assert "self == oldSelf" in rules, "run-defining spec must be immutable"
    assert "self.microTrainBatchSize <= self.trainBatchSize" in rules
    assert "x-kubernetes-validations" not in version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["suspend"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_and_round_trips_through_the_crd_schema(path: Path):
    manifest = yaml.safe_load(path.read_text())
    job = validate(manifest)
    # The manifest as written and with every default filled in both satisfy the generated schema.
    jsonschema.Draft4Validator(openapi()).validate(manifest)
    defaulted = job.model_dump(by_alias=True, exclude_none=True)
    jsonschema.Draft4Validator(openapi()).validate(defaulted)
    assert validate(defaulted) == job


def test_examples_cover_every_algorithm_family():
    algorithms = {yaml.safe_load(p.read_text())["spec"]["algorithm"] for p in EXAMPLES}
    assert {"ppo", "grpo", "reinforce++", "rloo", "dpo", "sft", "rm"} <= algorithms


def test_defaults_are_applied():
    job = validate(yaml.safe_load((ROOT / "manifests/examples/dpo-job.yaml").read_text()))
    assert job.spec.training.zero_stage == 3 and job.spec.training.kl.estimator == "k1"
    assert job.spec.rollout.samples_per_prompt == 1 and job.spec.resources.shm_size == "16Gi"


@pytest.mark.parametrize("algorithm,given,resolved", [
    ("grpo", None, "token-mean"),
    ("dr-grpo", None, "seq-mean-token-sum-norm"),
    ("dr-grpo", "token-mean", "token-mean"),
])
def test_loss_aggregation_defaults_to_the_algorithm_s(algorithm, given, resolved):
    """Unset, training.lossAggregation is the catalogue's default of the algorithm (Dr. GRPO's own for dr-grpo)."""
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    manifest["spec"]["algorithm"] = algorithm
    if given:
        manifest["spec"]["training"]["lossAggregation"] = given
    job = validate(manifest)
    assert job.spec.training.loss_aggregation == resolved
    assert "lossAggregation" not in openapi()["properties"]["spec"]["properties"]["training"]["default"]


def test_there_are_many_distinct_invalid_specs():
    assert len(INVALID) >= 15
    assert len({expectation(p, "expect") for p in INVALID}) == len(INVALID)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_spec_is_refused_naming_the_field_and_the_fix(path: Path):
    with pytest.raises(InvalidJob) as refused:
        validate(yaml.safe_load(path.read_text()))
    messages = [str(e) for e in refused.value.errors]
    assert any(expectation(path, "expect") in m for m in messages), messages


def test_cli_validate_exit_status_and_output(capsys):
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    assert "valid (ppo job ppo-llama3-8b)" in capsys.readouterr().out
    assert main(["validate", str(EXAMPLES[0]), str(INVALID[2])]) == 1
    err = capsys.readouterr().err
    assert "spec.rollout.samplesPerPrompt" in err and "invalid" in err


def test_cli_validate_reports_unreadable_and_foreign_documents(tmp_path, capsys):
    other = tmp_path / "deployment.yaml"
    other.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n")
    assert main(["validate", str(other), str(tmp_path / "missing.yaml")]) == 1
    err = capsys.readouterr().err
    assert "expected apiVersion: rlhf.dev/v1alpha1 and kind: RLHFJob" in err and "cannot read" in err


def test_cli_crd_prints_the_checked_in_crd(capsys):
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_FILE.read_text()
