"""Operator-time checks: specs the CRD admits but the cluster cannot run."""

from __future__ import annotations

import pytest
from operator_jobs import as_job, load_example, tiny

from rlhf_operator import checks


def no_claim(name: str) -> None:
    return None


def test_more_gpus_per_node_than_the_product_has_is_refused_with_the_fix():
    job = as_job(tiny(resources={"gpusPerNode": 16, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}))
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: True, no_claim, waited=0)
    assert refused.value.reason == "TooManyGPUsPerNode"
    assert "set gpusPerNode to 8 or less" in refused.value.message


@pytest.mark.parametrize("resources", [
    {"gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    {"gpusPerNode": 16, "gpuProduct": "Some-Future-GPU"},  # unknown products are not second-guessed
    {"gpusPerNode": 16},
])
def test_plausible_gpu_requests_pass(resources):
    checks.check(as_job(tiny(resources=resources)), lambda name: True, no_claim, waited=0)


def test_a_missing_environment_config_map_is_waited_for_like_a_reward_s():
    job = load_example("tiny-multiturn-cpu-job.yaml")
    job["spec"]["environment"]["function"]["configMap"] = "guess-game"
    with pytest.raises(checks.Waiting) as waiting:
        checks.check(as_job(job), lambda name: False, no_claim, waited=0)
    assert waiting.value.reason == "EnvironmentConfigMapNotFound"
    assert "the environment loads its code from ConfigMap 'guess-game'" in waiting.value.message
    checks.check(as_job(job), lambda name: name == "guess-game", no_claim, waited=0)


def test_a_missing_reward_config_map_is_waited_for_then_refused_naming_it():
    """kubectl apply -f dir/ applies in name order: the ConfigMap may come after the job."""
    job = as_job(load_example("grpo-job.yaml"))
    asked = []
    with pytest.raises(checks.Waiting) as waiting:
        checks.check(job, lambda name: asked.append(name) or False, no_claim, waited=checks.DEPENDENCY_WAIT_SECONDS - 1)
    assert asked == ["math-reward"]
    assert waiting.value.reason == "RewardConfigMapNotFound"
    assert "create configmap math-reward" in waiting.value.message and "waiting up to 600s" in waiting.value.message
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(job, lambda name: False, no_claim, waited=checks.DEPENDENCY_WAIT_SECONDS)
    assert not isinstance(refused.value, checks.Waiting)
    assert "after 600s" in refused.value.message and "create configmap math-reward" in refused.value.message
    checks.check(job, lambda name: name == "math-reward", no_claim, waited=0)


def claim_reader(modes: dict[str, list[str]], bound: bool = True):
    """Claims by name with those access modes, as the API server has them: a bound one's status
    holds its volume's."""
    def claim(name: str) -> dict | None:
        if name not in modes:
            return None
        return {"spec": {"accessModes": modes[name]}, "status": {"accessModes": modes[name]} if bound else {}}
    return claim


def on_claims(checkpoint: str | None = None, model: str | None = None):
    doc = tiny(resources={"nodes": 2})
    if checkpoint:
        doc["spec"]["checkpoint"] = {"pvc": checkpoint, "path": "/ckpt"}
    if model:
        doc["spec"]["models"]["actor"]["pvc"] = {"claimName": model}
    return as_job(doc)


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"])
def test_a_checkpoint_claim_not_every_pod_can_write_is_refused_with_the_fix(mode):
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(on_claims(checkpoint="ckpt"), lambda name: True, claim_reader({"ckpt": [mode]}), waited=0)
    assert refused.value.reason == "VolumeNotShared"
    assert refused.value.message == (
        f"spec.checkpoint.pvc: claim ckpt is {mode}: the head and 2 worker pods mount it on different nodes; "
        "use a ReadWriteMany claim (NFS, CephFS, Filestore, EFS, Lustre...)")


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_a_model_claim_one_node_at_a_time_is_refused(mode):
    with pytest.raises(checks.Unrealisable) as refused:
        checks.check(on_claims(model="weights"), lambda name: True, claim_reader({"weights": [mode]}), waited=0)
    assert refused.value.reason == "VolumeNotShared"
    assert refused.value.message.startswith(f"spec.models.actor.pvc: claim weights is {mode}:")
    assert "use a ReadWriteMany or ReadOnlyMany claim" in refused.value.message


def test_shared_claims_and_claims_not_there_yet_pass():
    """A missing claim is left to the scheduler, whose reason the job's status gives (as before)."""
    job = on_claims(checkpoint="ckpt", model="weights")
    checks.check(job, lambda name: True, claim_reader({"ckpt": ["ReadWriteMany"], "weights": ["ReadOnlyMany"]}),
                 waited=0)
    checks.check(job, lambda name: True, claim_reader({"ckpt": ["ReadWriteOnce", "ReadWriteMany"]}), waited=0)
    checks.check(job, lambda name: True, no_claim, waited=0)
    # Not bound yet: the modes it asks for.
    with pytest.raises(checks.Unrealisable, match="claim ckpt is ReadWriteOnce"):
        checks.check(job, lambda name: True, claim_reader({"ckpt": ["ReadWriteOnce"]}, bound=False), waited=0)
