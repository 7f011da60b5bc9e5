"""Specs the CRD admits but the cluster cannot run: Failed with a reason and the fix, no hot loop."""

from __future__ import annotations

import re

from e2e.fixtures import wait_for
from e2e.operator.jobs import children, create_job, events, rlhf_job, touch_and_wait_reconciled, wait_events, wait_phase


def reconcile_runs(metrics_text: str) -> int:
    match = re.search(r'rlhf_operator_reconcile_duration_seconds_count\{handler="reconcile"\} (\S+)', metrics_text)
    return int(float(match.group(1))) if match else 0


def assert_settles(kube, namespace, operator, name: str, reason: str) -> None:
    """After Failed, further updates are handled once each: one event, no children, no retries."""
    wait_for(lambda: [e["reason"] for e in events(kube, namespace, name)] == [reason], 30, f"one {reason} event")
    before = reconcile_runs(operator.metrics())
    for _ in range(3):
        touch_and_wait_reconciled(kube, namespace, name)
    assert reconcile_runs(operator.metrics()) - before == 3
    assert [e["reason"] for e in events(kube, namespace, name)] == [reason]
    assert [e.get("count") or 1 for e in events(kube, namespace, name)] == [1]
    assert not any(children(kube, namespace, name).values())
    assert "rlhf_operator_errors_total{" not in operator.metrics()


def test_more_gpus_per_node_than_the_product_has(kube, namespace, operator, kuberay_paused):
    operator.start()
    create_job(kube, namespace, rlhf_job("greedy", resources={"gpusPerNode": 16, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}))
    failed = wait_phase(kube, namespace, "greedy", "Failed", "TooManyGPUsPerNode")["status"]
    assert "set gpusPerNode to 8 or less" in failed["message"]
    assert failed["completionTime"] and "startTime" not in failed
    assert_settles(kube, namespace, operator, "greedy", "TooManyGPUsPerNode")


def test_a_missing_reward_config_map_is_waited_for(kube, namespace, operator, kuberay_paused):
    """Pending with the reason (no children, no hot loop) until the ConfigMap appears, then it starts."""
    operator.start()
    job = rlhf_job("grpo", algorithm="grpo", data={"prompts": {"sources": [{"path": "org/prompts"}]}},
                   rollout={"samplesPerPrompt": 4}, training={"rolloutBatchSize": 32, "trainBatchSize": 128},
                   reward={"sources": [{"name": "math", "type": "function",
                                        "function": {"entrypoint": "m.py:score", "configMap": "math-reward"}}]})
    create_job(kube, namespace, job)
    waiting = wait_phase(kube, namespace, "grpo", "Pending", "RewardConfigMapNotFound")["status"]
    assert "ConfigMap 'math-reward'" in waiting["message"]
    assert f"kubectl -n {namespace} create configmap math-reward" in waiting["message"]
    assert not any(children(kube, namespace, "grpo").values())
    wait_events(kube, namespace, "grpo", lambda e: e["reason"] == "RewardConfigMapNotFound", "its event")
    assert [e["reason"] for e in events(kube, namespace, "grpo")] == ["RewardConfigMapNotFound"]
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "math-reward", "namespace": namespace},
                 "data": {"m.py": "def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n"}})
    wait_phase(kube, namespace, "grpo", "Pending", "RayJobCreated", timeout=60)  # kopf's retry picked it up
    assert "rlhf_operator_errors_total{" not in operator.metrics()


def test_a_same_named_object_of_someone_else_is_not_taken_over(kube, namespace, operator, kuberay_paused):
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "mine-config", "namespace": namespace},
                 "data": {"note": "not the operator's"}})
    operator.start()
    create_job(kube, namespace, rlhf_job("mine"))
    failed = wait_phase(kube, namespace, "mine", "Failed", "NameConflict")["status"]
    assert "ConfigMap mine-config already exists" in failed["message"]
    assert kube.get("ConfigMap", namespace, "mine-config")["data"] == {"note": "not the operator's"}
    assert kube.get("RayJob", namespace, "mine") is None
