"""Operator-time checks: specs the CRD admits but the cluster cannot run."""

from __future__ import annotations

import pytest
from operator_jobs import as_job, load_example, tiny

from rlhf_operator import checks


def test_more_gpus_per_node_than_the_product_has_is_refused_with_the_fix():
    job = as_job(tiny(resources={"gpusPerNode": 16, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}))
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: True)
    assert refused.value.reason == "TooManyGPUsPerNode"
    assert "set gpusPerNode to 8 or less" in refused.value.message


@pytest.mark.parametrize("resources", [
    {"gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    {"gpusPerNode": 16, "gpuProduct": "Some-Future-GPU"},  # unknown products are not second-guessed
    {"gpusPerNode": 16},
])
def test_plausible_gpu_requests_pass(resources):
    checks.check(as_job(tiny(resources=resources)), lambda name: True)


def test_missing_reward_config_map_names_the_config_map_to_create():
    job = as_job(load_example("grpo-job.yaml"))
    asked = []
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: asked.append(name) or False)
    assert asked == ["math-reward"]
    assert refused.value.reason == "RewardConfigMapNotFound"
    assert "create configmap math-reward" in refused.value.message
    checks.check(job, lambda name: name == "math-reward")
