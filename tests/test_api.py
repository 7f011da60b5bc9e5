"""The RLHFJob API: the generated CRD, the examples, and `rlhf validate` on invalid specs."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from e2e.fixtures import example_jobs
from rlhf_api import crd, defaults_policy
from rlhf_api.algorithms import ALGORITHMS, CATALOGUE
from rlhf_api.validation import InvalidJob, validate
from rlhf_cli.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = example_jobs()
INVALID = sorted((ROOT / "tests" / "specs" / "invalid").glob("*.yaml"))
CRD_FILE = ROOT / "crds" / "rlhf.dev_rlhfjobs.yaml"
DEFAULTS_POLICY_FILE = ROOT / "helm" / "rlhf-operator" / "files" / "algorithm-defaults-policy.yaml"


def expectation(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.split(": ", 1)[1]
    raise AssertionError(f"{path.name} has no '# {key}:' line")


def openapi() -> dict:
    return crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_matches_the_api_models():
    assert CRD_FILE.read_text() == crd.render(), "crds/ drifted from the API models: run `make generate`"


def test_checked_in_defaults_policy_matches_the_catalogue():
    assert DEFAULTS_POLICY_FILE.read_text() == defaults_policy.render(), "the chart's algorithm-defaults policy drifted: run `make generate`"


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
    """Each kind of run the catalogue declares (dataset, model groups, grouped sampling) has an example."""
    def family(a):
        return a.dataset, a.roles, a.group_samples

    used = {family(ALGORITHMS[yaml.safe_load(p.read_text())["spec"]["algorithm"]]) for p in EXAMPLES}
    assert {family(a) for a in CATALOGUE} <= used


@pytest.mark.parametrize("path", [p for p in EXAMPLES if not p.name.endswith("-cpu-job.yaml")], ids=lambda p: p.name)
def test_cluster_examples_checkpoint_on_a_claim(path: Path):
    """Head and worker pods write one checkpoint, and the image's user cannot create /checkpoints in
    the pod (the *-cpu-job.yaml examples run on this machine with `rlhf run`)."""
    checkpoint = validate(yaml.safe_load(path.read_text())).spec.checkpoint
    assert checkpoint.pvc, f"{path.name}: set checkpoint.pvc (a ReadWriteMany claim) and checkpoint.path"


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


@pytest.mark.parametrize("example,given,resolved", [
    ("reinforce++-job.yaml", None, 0.9),  # training.colocation actor-reference: the engines' GPUs are their own
    ("grpo-job.yaml", None, 0.5),  # colocation all: the hybrid engine shares its GPUs with training
    ("reinforce++-job.yaml", 0.7, 0.7),
])
def test_engine_memory_defaults_to_vllm_s_unless_the_gpus_are_shared(example, given, resolved):
    """Engines on GPUs of their own took half of them (the field's former default, 0.5): the KV cache
    vLLM could have had, halved."""
    manifest = yaml.safe_load((ROOT / "manifests/examples" / example).read_text())
    if given:
        manifest["spec"]["rollout"]["gpuMemoryUtilization"] = given
    assert validate(manifest).spec.engine_memory_utilization == resolved


@pytest.mark.parametrize("dtype,bf16,engine", [
    ("bfloat16", True, "bfloat16"),  # the defaults: DeepSpeed's bf16, the engines in the weights' dtype
    ("float32", True, "bfloat16"),  # autocast on float32 weights: generation in bfloat16 too
    ("float32", False, "float32"),
    ("float16", True, "float16"),
])
def test_the_engines_generate_in_bfloat16_when_training_autocasts_float32_weights(dtype, bf16, engine):
    manifest = yaml.safe_load((ROOT / "manifests/examples/smollm2-grpo-cpu-job.yaml").read_text())
    manifest["spec"]["models"]["actor"]["dtype"] = dtype
    manifest["spec"]["training"]["bf16"] = bf16
    assert validate(manifest).spec.engine_dtype == engine


def test_there_are_many_distinct_invalid_specs():
    assert len(INVALID) >= 15
    assert len({expectation(p, "expect") for p in INVALID}) == len(INVALID)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_spec_is_refused_naming_the_field_and_the_fix(path: Path):
    with pytest.raises(InvalidJob) as refused:
        validate(yaml.safe_load(path.read_text()))
    messages = [str(e) for e in refused.value.errors]
    assert any(expectation(path, "expect") in m for m in messages), messages


def test_flash_attention_is_accepted_with_an_image_of_the_job_s_own():
    """Refused with the default image (tests/specs/invalid/38), which has no flash-attn."""
    doc = yaml.safe_load((ROOT / "tests/specs/invalid/38-flash-attention-without-an-image.yaml").read_text())
    doc["spec"]["resources"] = {"image": "registry.example/trainer-flash-attn:1"}
    assert validate(doc).spec.models.actor.attn_implementation == "flash_attention_2"


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


# Each case was checked against the real API server (e2e/test_admission_fuzz.py keeps checking it):
# types are read as the CRD's structural schema reads them, not as pydantic would coerce them.
TYPE_CASES = [
    # (path below spec, value, accepted, value after defaulting)
    (("backoffLimit",), True, False, None),  # a boolean is not an integer
    (("training", "seed"), "1", False, None),  # nor is a string
    (("training", "microTrainBatchSize"), 1.5, False, None),  # nor a fraction
    (("training", "seed"), 7.0, True, 7),  # kubectl sends a whole YAML float as an integer
    (("training", "seed"), 2**63, False, None),  # the API server's integers are int64
    (("training", "seed"), 1e21, False, None),  # Go writes this one as 1e+21: a float
    (("training", "zeroStage"), True, False, None),  # an integer enum too
    (("training", "bf16"), 1, False, None),  # an integer is not a boolean
    (("rollout", "enforceEager"), "true", False, None),  # nor is a string
    (("training", "learningRate"), True, False, None),  # a boolean is not a number
    (("rollout", "temperature"), 2, True, 2.0),  # an integer is a number
    (("resources", "shmSize"), 8, False, None),  # a quantity is a string here, not int-or-string
    (("training", "lrScheduler"), "linear", True, "linear"),  # enums take their strings
]


def _set(manifest: dict, path: tuple, value) -> None:
    node = manifest["spec"]
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


@pytest.mark.parametrize("path,value,accepted,stored", TYPE_CASES, ids=lambda v: repr(v))
def test_types_are_checked_as_the_api_server_checks_them(path, value, accepted, stored):
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, path, value)
    if not accepted:
        with pytest.raises(InvalidJob) as refused:
            validate(manifest)
        assert [e.path for e in refused.value.errors] == ["spec." + ".".join(path)]
        return
    node = validate(manifest).spec.model_dump(by_alias=True)
    for part in path:
        node = node[part]
    assert node == stored and type(node) is type(stored)


def test_type_errors_say_what_to_write():
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, ("training", "bf16"), "false")
    _set(manifest, ("backoffLimit",), True)
    with pytest.raises(InvalidJob) as refused:
        validate(manifest)
    messages = {e.path: e.message for e in refused.value.errors}
    assert "write true or false unquoted" in messages["spec.training.bf16"]
    assert "expected an integer" in messages["spec.backoffLimit"]


def test_a_null_field_is_an_absent_one_as_the_api_server_prunes_it():
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, ("suspend",), None)
    _set(manifest, ("checkpoint",), None)
    _set(manifest, ("resources", "nodeSelector"), {"pool": None, "zone": "a"})
    spec = validate(manifest).spec
    assert spec.suspend is False and spec.checkpoint.keep == 3
    assert spec.resources.node_selector == {"zone": "a"}
    _set(manifest, ("algorithm",), None)  # a required one is missing, as on the server
    with pytest.raises(InvalidJob, match="spec.algorithm: required field is missing"):
        validate(manifest)


def test_a_manifest_names_fields_in_camel_case_only():
    """The API server refuses spec.training.micro_train_batch_size as an unknown field; so does
    `rlhf validate` (Python code may still construct models by field name)."""
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, ("training", "micro_train_batch_size"), 2)
    with pytest.raises(InvalidJob) as refused:
        validate(manifest)
    assert refused.value.errors[0].path == "spec.training.micro_train_batch_size"
    assert "unknown field" in refused.value.errors[0].message


def test_an_integer_beyond_int64_inside_a_kept_object_is_a_float_as_on_the_api_server():
    """tolerations are kept as sent; the API server's decoder holds 2**70 there as a float64 (and
    `rlhf validate` used to crash on it in the CEL library); in a typed integer field it is refused."""
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, ("resources", "tolerations"), [{"key": "a", "operator": "Exists", "tolerationSeconds": 2**70}])
    assert validate(manifest).spec.resources.tolerations[0]["tolerationSeconds"] == float(2**70)
    _set(manifest, ("training", "seed"), -(2**63) - 1)
    with pytest.raises(InvalidJob, match="spec.training.seed: Input should fit in a 64-bit integer"):
        validate(manifest)


def test_a_rule_that_cannot_be_evaluated_refuses_the_job_as_the_api_server_does():
    """rolloutBatchSize * samplesPerPrompt overflows int64: the API server answers "integer overflow
    evaluating rule: ..." and refuses; `rlhf validate` used to crash in the CEL library."""
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    _set(manifest, ("training", "rolloutBatchSize"), 2**63 - 1)
    with pytest.raises(InvalidJob) as refused:
        validate(manifest)
    (error,) = refused.value.errors
    assert error.path == "spec" and "each rollout must split into whole optimizer steps" in error.message
    assert "cannot be evaluated" in error.message


# The network fields (issue 52, item 3), each case as a real API server with the generated CRD answered it.
NETWORK_CASES = [
    # (spec.resources, the refused field or None, words of the refusal)
    ({"gpusPerNode": 8, "hostNetwork": True, "podLabels": {"team": "a", "example.com/cost-centre": "x-1"},
      "podAnnotations": {"example.com/owner": "{\"name\": \"ana\"}"},
      "worker": {"podAnnotations": {"k8s.v1.cni.cncf.io/networks": "roce-net"}},
      "rdma": {"hca": "=mlx5_0:1,mlx5_1:1", "gidIndex": 3, "trafficClass": 106}}, None, ""),
    ({"gpusPerNode": 8, "rdma": {"hca": "^=mlx5_2"}}, None, ""),
    ({"gpusPerNode": 8, "rdma": {"hca": "mlx5_0:a"}}, "spec.resources.rdma.hca", "in NCCL's syntax"),
    ({"gpusPerNode": 8, "rdma": {"trafficClass": 256}}, "spec.resources.rdma.trafficClass", "less than or equal to 255"),
    ({"podLabels": {"-team": "a"}}, "spec.resources.podLabels", "each label key is a name"),
    ({"podLabels": {"a" * 64: "a"}}, "spec.resources.podLabels", "each label key is a name"),
    ({"podLabels": {"Example.com/team": "a"}}, "spec.resources.podLabels", "each label key is a name"),
    ({"podAnnotations": {"a" * 254 + "/b": "a"}}, "spec.resources.podAnnotations", "each annotation key is a name"),
    ({"podLabels": {"team": "-a"}}, "spec.resources.podLabels.team", "has the wrong form"),
    ({"podLabels": {"rlhf.dev/job": "other"}}, "spec.resources.podLabels", "the operator sets the labels"),
    ({"worker": {"podAnnotations": {"rlhf.dev/job-name": "other"}}}, "spec.resources.worker.podAnnotations",
     "the operator sets the annotations"),
    ({"gpusPerNode": 0, "hostNetwork": True}, "spec.resources.hostNetwork", "hostNetwork is for NCCL between GPU workers"),
]


@pytest.mark.parametrize("resources,field,words", NETWORK_CASES, ids=lambda v: repr(v)[:60])
def test_network_fields_are_admitted_as_the_api_server_admits_them(resources, field, words):
    manifest = yaml.safe_load((ROOT / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    manifest["spec"]["resources"] |= resources
    if field is None:
        validate(manifest)
        return
    with pytest.raises(InvalidJob) as refused:
        validate(manifest)
    assert [(e.path, words in e.message) for e in refused.value.errors] == [(field, True)], refused.value.errors
