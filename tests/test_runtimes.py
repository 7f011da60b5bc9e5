"""A runtime applied to a job (rlhf_api/runtimes.py): field by field, the job's own values win, what it leaves
at a default takes the runtime's, sections merge field by field, the trainer image follows the job's device,
locked fields a job sets are named; the runtime CRDs are generated from the same models and documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_api import crd, reference
from rlhf_api.runtimes import applied, default_runtime, locked_fields_set
from rlhf_api.v1alpha1 import RLHFRuntime
from rlhf_api.v1alpha1.runtime import RUNTIME_RESOURCES
from rlhf_api.validation import validate
from rlhf_cli.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "manifests" / "examples"
H100 = RLHFRuntime.model_validate({"metadata": {"name": "h100"}, "spec": {
    "trainerImages": {"cpu": "reg/trainer:1-cpu", "cuda": "reg/trainer:1-cuda"}, "queueName": "gpu",
    "resources": {"shmSize": "64Gi", "tolerations": [{"key": "pool", "operator": "Exists"}], "head": {"cpu": "2"},
                  "rdma": {"hca": "=mlx5_0,mlx5_1"}, "nodeSelector": {"pool": "h100"}},
    "locked": ["rdma", "queueName"]}}).spec


def _job(**resources):
    manifest = yaml.safe_load((EXAMPLES / "grpo-job.yaml").read_text())
    manifest["spec"]["resources"] = {"gpusPerNode": 8, **resources}
    return validate(manifest).spec


def test_what_a_job_leaves_at_its_default_takes_the_runtime_s_and_its_own_values_win():
    spec = applied(_job(nodeSelector={"team": "a"}, head={"memory": "8Gi"}), H100)
    resources = spec.resources
    assert resources.shm_size == "64Gi" and resources.tolerations == [{"key": "pool", "operator": "Exists"}]
    assert resources.node_selector == {"team": "a"}  # the job's own
    assert (resources.head.cpu, resources.head.memory) == ("2", "8Gi")  # a section merges field by field
    assert resources.rdma.hca == "=mlx5_0,mlx5_1" and resources.image == "reg/trainer:1-cuda"  # a GPU job
    assert spec.queue_name == "gpu" and spec.resources.nodes == 1  # job-only fields are the job's
    assert applied(_job(gpusPerNode=0), H100).resources.image == "reg/trainer:1-cpu"
    assert applied(_job(image="mine:1"), H100).resources.image == "mine:1"


def test_a_runtime_s_placement_per_kind_of_pod_merges_field_by_field_with_the_job_s():
    runtime = RLHFRuntime.model_validate({"metadata": {"name": "pools"}, "spec": {"resources": {
        "head": {"nodeSelector": {"pool": "cpu"}},
        "worker": {"tolerations": [{"key": "gpu-pool", "operator": "Exists"}], "nodeSelector": {"pool": "h100"}}}}}).spec
    resources = applied(_job(head={"cpu": "2"}, worker={"nodeSelector": {"pool": "a100"}}), runtime).resources
    assert (resources.head.cpu, resources.head.node_selector) == ("2", {"pool": "cpu"})
    assert resources.worker.node_selector == {"pool": "a100"}  # the job's own
    assert resources.worker.tolerations == [{"key": "gpu-pool", "operator": "Exists"}]


def test_locked_fields_the_job_sets_are_named_and_defaults_are_not_set():
    assert locked_fields_set(_job(), H100) == []
    manifest_spec = _job(rdma={"hca": "mlx5"})
    assert locked_fields_set(manifest_spec, H100) == ["spec.resources.rdma"]
    assert locked_fields_set(manifest_spec.model_copy(update={"queue_name": "mine"}), H100) == [
        "spec.resources.rdma", "spec.queueName"]


def _marked(kind: str, name: str, created: str | None = None, default: bool = True) -> dict:
    return {"kind": kind, "metadata": {"name": name, **({"creationTimestamp": created} if created else {})},
            "spec": {"default": default}}


def test_one_default_rule_the_namespace_s_before_the_cluster_s_then_the_oldest_then_the_name():
    old_cluster = _marked("ClusterRLHFRuntime", "old", "2026-01-01T00:00:00Z")
    new_cluster = _marked("ClusterRLHFRuntime", "a-new", "2026-02-01T00:00:00Z")
    unmarked = _marked("ClusterRLHFRuntime", "older", "2025-01-01T00:00:00Z", default=False)
    assert default_runtime([new_cluster, unmarked, old_cluster]) is old_cluster  # the oldest marked, not the name
    team = _marked("RLHFRuntime", "team", "2026-03-01T00:00:00Z")
    assert default_runtime([old_cluster, team]) is team  # the namespace's first, however new
    not_created = _marked("ClusterRLHFRuntime", "0-from-a-file")  # rlhf validate's file: the newest
    assert default_runtime([not_created, new_cluster]) is new_cluster
    assert default_runtime([_marked("ClusterRLHFRuntime", "b"), _marked("ClusterRLHFRuntime", "a")])["metadata"][
        "name"] == "a"  # equal ages: by name
    assert default_runtime([unmarked]) is None


def test_a_runtime_sets_every_cluster_field_of_resources_and_none_of_the_job_s_own():
    assert {"nodes", "gpusPerNode", "gpus", "topology"}.isdisjoint(
        {name for name in RUNTIME_RESOURCES})  # field names, not aliases: nodes, gpus_per_node...
    assert "gpus_per_node" not in RUNTIME_RESOURCES and "tolerations" in RUNTIME_RESOURCES


@pytest.mark.parametrize("kind", ["RLHFRuntime", "ClusterRLHFRuntime"])
def test_checked_in_runtime_crds_match_the_models_and_the_reference_documents_them(kind, capsys):
    path = ROOT / "crds" / f"rlhf.dev_{kind.lower()}s.yaml"
    assert path.read_text() == crd.render(kind), "crds/ drifted from the API models: run `make generate`"
    assert main(["crd", "--kind", kind]) == 0 and capsys.readouterr().out == path.read_text()
    definition = yaml.safe_load(path.read_text())
    assert definition["spec"]["scope"] == ("Cluster" if kind.startswith("Cluster") else "Namespaced")
    spec = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["resources"]["properties"]["tolerations"]["description"]
    page = reference.markdown()
    assert "## `runtime.spec.resources`" in page and "| `locked` |" in page


def test_rlhf_validate_applies_a_runtime_given_beside_the_job_and_refuses_what_it_locks(tmp_path, capsys):
    runtime_file = EXAMPLES / "runtimes" / "h100-infiniband.yaml"
    job = EXAMPLES / "ppo-job.yaml"
    assert main(["validate", "--gpu", "--model-configs", str(EXAMPLES / "model-configs"), str(job),
                 str(runtime_file)]) == 0
    out = capsys.readouterr().out
    assert "valid (ppo job ppo-llama3-8b, with ClusterRLHFRuntime h100-infiniband)" in out
    assert "GPU NVIDIA-H100-80GB-HBM3" in out  # the runtime's gpuProduct planned the job
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["resources"]["rdma"] = {"hca": "mlx5"}
    (mine := tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    assert main(["validate", str(mine), str(runtime_file)]) == 1
    assert "spec.resources.rdma: ClusterRLHFRuntime h100-infiniband sets it for every job and locks it" in \
        capsys.readouterr().err


def test_kubectl_explain_documents_every_runtime_field():
    definition = yaml.safe_load((ROOT / "crds" / "rlhf.dev_clusterrlhfruntimes.yaml").read_text())
    spec = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def undocumented(node, path):
        found = []
        for name, child in node.get("properties", {}).items():
            if not child.get("description"):
                found.append(f"{path}.{name}")
            found += undocumented(child.get("items", child), f"{path}.{name}")
        return found

    assert undocumented(spec, "spec") == []
