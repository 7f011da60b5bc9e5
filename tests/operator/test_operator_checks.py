"""Operator-time checks: specs the CRD admits but the cluster cannot run."""

from __future__ import annotations

import pytest
from operator_jobs import as_job, load_example, tiny

from rlhf_operator import checks


def test_more_gpus_per_node_than_the_product_has_is_refused_with_the_fix():
    job = as_job(tiny(resources={"gpusPerNode": 16, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}))
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: True, waited=0)
    assert refused.value.reason == "TooManyGPUsPerNode"
    assert "set gpusPerNode to 8 or less" in refused.value.message


@pytest.mark.parametrize("resources", [
    {"gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    {"gpusPerNode": 16, "gpuProduct": "Some-Future-GPU"},  # unknown products are not second-guessed
    {"gpusPerNode": 16},
])
def test_plausible_gpu_requests_pass(resources):
    checks.check(as_job(tiny(resources=resources)), lambda name: True, waited=0)


def test_a_missing_environment_config_map_is_waited_for_like_a_reward_s():
    job = load_example("tiny-multiturn-cpu-job.yaml")
    job["spec"]["environment"]["function"]["configMap"] = "guess-game"
    with pytest.raises(checks.Waiting) as waiting:
        checks.check(as_job(job), lambda name: False, waited=0)
    assert waiting.value.reason == "EnvironmentConfigMapNotFound"
    assert "the environment loads its code from ConfigMap 'guess-game'" in waiting.value.message
    checks.check(as_job(job), lambda name: name == "guess-game", waited=0)


def test_a_missing_reward_config_map_is_waited_for_then_refused_naming_it():
    """kubectl apply -f dir/ applies in name order: the ConfigMap may come after the job."""
    job = as_job(load_example("grpo-job.yaml"))
    asked = []
    with pytest.raises(checks.Waiting) as waiting:
        checks.check(job, lambda name: asked.append(name) or False, waited=checks.DEPENDENCY_WAIT_SECONDS - 1)
    assert asked == ["math-reward"]
    assert waiting.value.reason == "RewardConfigMapNotFound"
    assert "create configmap math-reward" in waiting.value.message and "waiting up to 600s" in waiting.value.message
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: False, waited=checks.DEPENDENCY_WAIT_SECONDS)
    assert not isinstance(refused.value, checks.Waiting)
    assert "after 600s" in refused.value.message and "create configmap math-reward" in refused.value.message
    checks.check(job, lambda name: name == "math-reward", waited=0)
