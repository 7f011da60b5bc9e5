"""Every example runs as shipped.

- Each cluster example (manifests/examples/*-job.yaml but the *-cpu-job.yaml ones, which `rlhf run` runs from a
  checkout, and pipeline/) names no ConfigMap, Secret, claim, runtime or input job that its folder neither
  defines (prerequisites/kustomization.yaml's output, runtimes/, the jobs beside it) nor documents (a
  *.example.yaml placeholder); tiny-grpo-cluster-job.yaml's are the dev cluster's, made by e2e/pods/devcluster.py.
- The prerequisites, the runtimes and every cluster example pass the API server's admission (server-side dry run).
- The reward and environment code loads from its ConfigMap as the pods mount it, and scores as the job needs.
- The Argo CD Applications sync nothing that needs a GPU or a checkout.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.binaries import find_kubectl
from e2e.fixtures import example_jobs
from e2e.pods.devcluster import EXAMPLE as DEV_CLUSTER_EXAMPLE, example_names
from rlhf_api.crd import openapi_schema
from rlhf_api.paths import is_hub_id
from rlhf_api.v1alpha1 import RLHFJob
from rlhf_api.v1alpha1.runtime import CLUSTER_RUNTIME_KIND
from rlhf_api.validation import validate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "manifests" / "examples"
PREREQUISITES = EXAMPLES / "prerequisites"
RUNTIMES = sorted((EXAMPLES / "runtimes").glob("*.yaml"))
ARGOCD = ROOT / "manifests" / "argocd"
CLUSTER_EXAMPLES = [p for p in example_jobs() if not p.name.endswith("-cpu-job.yaml")]
PLACEHOLDER = "REPLACE-WITH-"  # the value a placeholder Secret holds instead of a credential

# The fields of the API that name another object in the job's namespace (each checked against the CRD's schema
# below), and the core/v1 EnvVar and EnvFromSource fields that do (resources.env, resources.envFrom).
SECRET_FIELDS = {"authSecretRef", "apiKeySecret", "usernameSecret", "passwordSecret", "tokenSecret",
                 "secretKeyRef", "secretRef"}
CONFIG_MAP_FIELDS = {"configMapKeyRef", "configMapRef"}
REFERENCE_FIELDS = {"fromJob", "runtimeRef", "pvc", "claimName", "configMap", "imagePullSecrets", *SECRET_FIELDS,
                    *CONFIG_MAP_FIELDS}


def references(value: Any) -> Iterator[tuple[str, str]]:
    """(kind, name) of each object a job's spec names."""
    if isinstance(value, list):
        for item in value:
            yield from references(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key == "fromJob":
                yield "RLHFJob", item["name"]
            elif key == "runtimeRef":
                yield item.get("kind", CLUSTER_RUNTIME_KIND), item["name"]
            elif key == "pvc":  # a model's {claimName}, or checkpoint.pvc's name
                yield "PersistentVolumeClaim", item["claimName"] if isinstance(item, dict) else item
            elif key == "configMap":
                yield "ConfigMap", item
            elif key == "imagePullSecrets":
                yield from (("Secret", name) for name in item)
            elif key in SECRET_FIELDS:
                yield "Secret", item["name"]
            elif key in CONFIG_MAP_FIELDS:
                yield "ConfigMap", item["name"]
            else:
                yield from references(item)


@functools.cache
def kustomize(folder: Path) -> list[dict[str, Any]]:
    built = subprocess.run([find_kubectl(), "kustomize", str(folder)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def placeholders() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, doc) for p in sorted(PREREQUISITES.glob("*.example.yaml")) for doc in yaml.safe_load_all(p.read_text())]


def named(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(doc["kind"], doc["metadata"]["name"]) for doc in docs}


def test_references_reads_every_field_of_the_api_that_names_an_object():
    found = set()

    def walk(schema: dict[str, Any]) -> None:
        for name, prop in (schema.get("properties") or {}).items():
            if re.search(r"secret|configmap|pvc|claim|fromjob|runtime", name, re.I):
                found.add(name)
            walk(prop)
        if "items" in schema:
            walk(schema["items"])

    walk(openapi_schema(RLHFJob)["properties"]["spec"])
    assert found and found <= REFERENCE_FIELDS, f"a field names an object that references() does not read: {found - REFERENCE_FIELDS}"


@pytest.mark.parametrize("example", CLUSTER_EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_a_cluster_example_names_only_what_its_folder_defines_or_documents(example: Path):
    job = yaml.safe_load(example.read_text())
    named_here = set(references(job["spec"]))
    if example == DEV_CLUSTER_EXAMPLE:  # `make dev-cluster-up` makes its claims and ConfigMap
        models, checkpoints, reward = example_names()
        provided = {("PersistentVolumeClaim", models), ("PersistentVolumeClaim", checkpoints), ("ConfigMap", reward)}
    else:
        jobs = named([yaml.safe_load(p.read_text()) for p in example.parent.glob("*.yaml")])
        runtimes = named([yaml.safe_load(p.read_text()) for p in RUNTIMES])
        provided = jobs | runtimes | named(kustomize(PREREQUISITES)) | named([doc for _, doc in placeholders()])
    assert named_here - provided == set(), f"{example.name} names what manifests/examples/ lacks"


def test_the_examples_name_each_kind_of_prerequisite():
    """references() is not blind: the examples between them name a claim, a ConfigMap, a Secret, a runtime and an
    input job."""
    kinds = {kind for p in CLUSTER_EXAMPLES for kind, _ in references(yaml.safe_load(p.read_text())["spec"])}
    assert kinds == {"PersistentVolumeClaim", "ConfigMap", "Secret", CLUSTER_RUNTIME_KIND, "RLHFJob"}


# What a GPU pool's runtime sets, never its jobs: the pool, its taints and placement, RDMA and NCCL.
CLUSTER_CONVENTIONS = {"gpuProduct", "nodeSelector", "tolerations", "affinity", "rdma", "hostNetwork", "podAnnotations"}


@pytest.mark.parametrize("example", [p for p in CLUSTER_EXAMPLES if "gpusPerNode: 0" not in p.read_text()],
                         ids=lambda p: p.name)
def test_a_gpu_example_names_a_runtime_beside_it_instead_of_the_cluster_s_conventions(example: Path):
    spec = yaml.safe_load(example.read_text())["spec"]
    assert spec.get("runtimeRef", {}).get("name") in {p.stem for p in RUNTIMES}, f"{example.name} names no runtime"
    resources = spec["resources"]
    kinds = [resources, resources.get("head") or {}, resources.get("worker") or {}]
    assert not {key for fields in kinds for key in fields} & CLUSTER_CONVENTIONS, example.name
    assert f"kubectl apply -f manifests/examples/runtimes/{spec['runtimeRef']['name']}.yaml" in example.read_text()


def test_a_placeholder_says_how_to_make_its_secret_and_holds_no_credential():
    assert placeholders()
    applied = named(kustomize(PREREQUISITES))
    for path, doc in placeholders():
        name = doc["metadata"]["name"]
        assert doc["kind"] == "Secret" and ("Secret", name) not in applied, f"{path.name}: never applied as it is"
        assert f"kubectl create secret generic {name} " in path.read_text(), path.name
        assert all(value.startswith(PLACEHOLDER) for value in doc["stringData"].values()), path.name


def test_the_prerequisites_and_the_cluster_examples_pass_admission(control_plane, namespace):
    """As their comments say to apply them: the kustomization, a placeholder filled in, the runtimes, each job."""
    dry_run = ("apply", "--dry-run=server", "-n", namespace)
    made = control_plane.kubectl(*dry_run, "-k", str(PREREQUISITES)).stdout
    assert made.count("(server dry run)") == len(kustomize(PREREQUISITES)), made
    files = [path for path, _ in placeholders()] + RUNTIMES + CLUSTER_EXAMPLES
    applied = control_plane.kubectl(*dry_run, *(arg for path in files for arg in ("-f", str(path)))).stdout
    assert applied.count("(server dry run)") == len(files), applied


def mounted(config_map: str, tmp_path: Path) -> Path:
    """The ConfigMap as the pods mount it: a file per key."""
    (data,) = [doc["data"] for doc in kustomize(PREREQUISITES) if named([doc]) == {("ConfigMap", config_map)}]
    for key, text in data.items():
        (tmp_path / key).write_text(text)
    return tmp_path


GSM8K_LABEL = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_the_grpo_example_s_reward_scores_gsm8k_answers(tmp_path):
    from rlhf_trainer.rewards.function import check_signature, load_entrypoint

    source = validate(yaml.safe_load((EXAMPLES / "grpo-job.yaml").read_text())).spec.reward.sources[0]
    function = source.function
    _, score = load_entrypoint(function.entrypoint, mounted(function.config_map, tmp_path), function.config_map,
                               "rlhf_test_math_reward")
    check_signature(score, function.entrypoint)
    completions = ["She sold 24 then 48 + 24 = 72, so the answer is \\boxed{72}.", "#### 72.00", "72 clips",
                   "\\boxed{71} (not 72)", "48 + 24 = \\boxed{"]
    assert score(["q"] * 5, completions, [GSM8K_LABEL] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_the_tool_use_example_s_environment_runs_an_episode(tmp_path):
    from rlhf_trainer.rewards.function import load_entrypoint

    function = validate(yaml.safe_load((EXAMPLES / "tool-use-grpo-job.yaml").read_text())).spec.environment.function
    _, environment = load_entrypoint(function.entrypoint, mounted(function.config_map, tmp_path), function.config_map,
                                     "rlhf_test_calculator")
    episode = environment()
    episode.reset("How many clips?", GSM8K_LABEL)
    observation, reward, done = episode.step("First, <calc>48 / 2</calc>")
    assert "<result>24</result>" in observation and (reward, done) == (0.0, False)
    assert episode.step("48 + 24 = 72\n#### 72") == ("", 1.0, True)


# --------------------------------------------------------------------------------------------- Argo CD


def expand_braces(pattern: str) -> list[str]:
    """Argo CD's globs take {a,b} alternatives (one level), which fnmatch does not."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [p for choice in match.group(1).split(",")
            for p in expand_braces(pattern[:match.start()] + choice + pattern[match.end():])]


def synced(application: Path) -> list[Path]:
    """The files an Argo CD directory Application syncs: the manifests under its path (in subfolders with
    recurse), those its include matches when it has one, less those its exclude matches (paths relative to
    its path)."""
    source = yaml.safe_load(application.read_text())["spec"]["source"]
    directory, root = source.get("directory") or {}, ROOT / source["path"]
    files = root.rglob("*") if directory.get("recurse") else root.glob("*")

    def matches(pattern: str | None, path: Path) -> bool:
        return any(fnmatch.fnmatchcase(str(path.relative_to(root)), p) for p in expand_braces(pattern or ""))

    return sorted(p for p in files if p.suffix in (".yaml", ".yml", ".json")
                  and (not directory.get("include") or matches(directory["include"], p))
                  and not matches(directory.get("exclude"), p))


def checkout_folders() -> set[str]:
    """The folders beside the examples that their relative paths name: those in the checkout and those `make`
    builds there (.gitignore)."""
    ignored = [line.split("/")[2] for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.startswith("manifests/examples/")]
    return {p.name for p in EXAMPLES.iterdir() if p.is_dir()} | set(ignored)


def checkout_paths(value: Any) -> Iterator[str]:
    """The paths a job's spec reads relative to the job file's folder: a file.py entrypoint, or a relative path
    that is no hub id or starts in a folder of the examples; one on a claim or in a ConfigMap is not."""
    if isinstance(value, list):
        for item in value:
            yield from checkout_paths(item)
    elif isinstance(value, dict):
        beside_the_job = not {"pvc", "configMap", "fromJob"} & value.keys()
        for key, item in value.items():
            if key == "entrypoint" and beside_the_job and item.rsplit(":", 1)[0].endswith(".py"):
                yield item
            elif key == "path" and beside_the_job and not item.startswith("/") and (
                    not is_hub_id(item) or item.split("/")[0] in checkout_folders()):
                yield item
            else:
                yield from checkout_paths(item)


def test_the_checkout_path_rule_finds_the_paths_of_every_cpu_example():
    for example in (p for p in example_jobs() if p.name.endswith("-cpu-job.yaml")):
        assert list(checkout_paths(yaml.safe_load(example.read_text())["spec"])), example.name


@pytest.mark.parametrize("application", ["application.yaml", "pipeline-application.yaml"])
def test_argo_cd_syncs_nothing_that_needs_a_gpu_or_a_checkout(application: str):
    files = synced(ARGOCD / application)
    assert files, f"{application} syncs nothing"
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] == "RLHFJob", path.name
            assert validate(doc).spec.resources.gpus_per_node == 0, f"{path.name} needs GPUs"
            assert list(checkout_paths(doc["spec"])) == [], f"{path.name} reads paths of a checkout"
