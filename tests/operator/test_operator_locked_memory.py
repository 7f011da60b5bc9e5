"""resources.rdma.requireLockedMemory: an RDMA job's GPU ranks fail (NodeUnusable) rather than warn under a
memlock limit (tests/trainer/test_distributed_limits.py); the field as `kubectl explain` and the API server
see it, and as the operator passes it to the GPU workers."""

from __future__ import annotations

import jsonschema
import pytest
from operator_jobs import as_job, tiny

from rlhf_api import contract, crd
from rlhf_api.validation import InvalidJob, validate
from rlhf_operator import render

FIELD = "spec.resources.rdma.requireLockedMemory"


def schema() -> dict:
    return crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def rdma_job(**rdma) -> dict:
    return tiny(resources={"gpusPerNode": 8, "rdma": rdma})


def test_the_field_is_an_explained_boolean_off_by_default():
    field = schema()["properties"]["spec"]["properties"]["resources"]["properties"]["rdma"]["properties"][
        "requireLockedMemory"]
    assert (field["type"], field["default"]) == ("boolean", False)
    assert "NodeUnusable" in field["description"] and "LimitMEMLOCK=infinity" in field["description"]
    assert validate(rdma_job()).spec.resources.rdma.require_locked_memory is False


def test_a_quoted_boolean_is_refused_by_the_schema_and_the_operator():
    doc = rdma_job(requireLockedMemory="true")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema()).validate(doc)
    with pytest.raises(InvalidJob) as refused:
        validate(doc)
    assert any(FIELD in str(error) for error in refused.value.errors), refused.value.errors


@pytest.mark.parametrize("strict", [True, False])
def test_only_a_strict_job_s_gpu_workers_are_told_to_fail(strict):
    cluster = render.ray_job(as_job(rdma_job(requireLockedMemory=strict)))["spec"]["rayClusterSpec"]
    [worker] = cluster["workerGroupSpecs"]
    for group, told in ((worker, strict), (cluster["headGroupSpec"], False)):
        [container] = group["template"]["spec"]["containers"]
        values = {var["name"]: var.get("value") for var in container["env"]}
        assert values.get(contract.REQUIRE_LOCKED_MEMORY_ENV) == ("true" if told else None)
