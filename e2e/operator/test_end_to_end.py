"""The product's promise in one test: `kubectl apply` a job, watch it train, read its numbers in `kubectl get`.

The control plane, the operator and the trainer are real. No container runtime exists here, so
e2e/podruntime.py plays the head pod: it mounts the job's ConfigMaps and a real ServiceAccount
token where the pod spec says, starts a real Ray head, submits the RayJob's entrypoint through
Ray's Jobs API and writes the RayJob status KubeRay would (see that module for what it does not do).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e.operator.jobs import events, get_job, wait_phase
from e2e.podruntime import HeadPod
from rlhf_api import v1alpha1 as api

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "manifests" / "examples" / "tiny-grpo-cpu-job.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def tiny_job(tmp_path: Path, model: Path, reward_config_map: str, name: str = "tiny-grpo") -> Path:
    """The tiny CPU example as one would ship it to a cluster: absolute paths (the "image"), the reward from a ConfigMap."""
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    job["metadata"]["name"] = name
    spec["models"]["actor"]["path"] = str(model)
    spec["data"]["prompts"]["sources"][0]["path"] = str(EXAMPLE.parent / "tiny" / "prompts.jsonl")
    spec["reward"]["sources"][0]["function"] = {"entrypoint": "reward.py:score", "configMap": reward_config_map}
    spec["training"]["maxSteps"] = STEPS
    spec["checkpoint"] = {"path": str(tmp_path / "checkpoints"), "intervalSteps": 2, "keep": 1}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_head(control_plane, kube, kube_api, namespace: str, job_name: str) -> tuple[str, str]:
    job = wait_phase(kube, namespace, job_name, "Pending", timeout=60)
    head = HeadPod(control_plane, kube, kube_api.core, namespace, job["status"]["rayJobName"])
    try:
        head.start()
        return head.run_job()
    finally:
        head.stop()


def test_kubectl_apply_trains_to_succeeded_with_numbers_in_kubectl_get(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path):
    operator.start()
    control_plane.kubectl("-n", namespace, "create", "configmap", "letter-reward",
                          f"--from-file=reward.py={EXAMPLE.parent / 'tiny' / 'reward.py'}")
    control_plane.kubectl("-n", namespace, "apply", "-f", str(tiny_job(tmp_path, tiny_model, "letter-reward")))

    state, logs = run_head(control_plane, kube, kube_api, namespace, "tiny-grpo")
    assert state == "SUCCEEDED", logs

    job = wait_phase(kube, namespace, "tiny-grpo", "Succeeded", timeout=60)
    status = job["status"]
    assert status["progress"]["step"] == STEPS and status["progress"]["summary"] == f"{STEPS}/{STEPS}"
    assert 0.0 <= status["metrics"]["rewardMean"] <= 1.0
    assert status["metrics"]["tokensPerSecond"] > 0
    assert status["lastCheckpoint"]["step"] == STEPS  # saved every 2 steps and at the end
    assert status["lastCheckpoint"]["path"].startswith(str(tmp_path / "checkpoints"))
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    assert status["startTime"] and status["completionTime"]

    table = control_plane.kubectl("-n", namespace, "get", "rlhfjobs").stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "ALGORITHM", "PHASE", "PROGRESS", "REWARD"]
    assert row.split()[:4] == ["tiny-grpo", "grpo", "Succeeded", f"{STEPS}/{STEPS}"]
    assert float(row.split()[4]) == pytest.approx(status["metrics"]["rewardMean"], abs=1e-3)


def test_a_reward_function_that_raises_fails_the_job_with_its_message(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path):
    broken = tmp_path / "reward.py"
    broken.write_text("def score(prompts, completions, labels):\n"
                      "    raise ValueError('label set is empty: check labelKey in the job')\n")
    operator.start()
    control_plane.kubectl("-n", namespace, "create", "configmap", "broken-reward", f"--from-file=reward.py={broken}")
    control_plane.kubectl("-n", namespace, "apply", "-f",
                          str(tiny_job(tmp_path, tiny_model, "broken-reward", name="broken-reward")))

    state, logs = run_head(control_plane, kube, kube_api, namespace, "broken-reward")
    assert state == "FAILED", logs

    job = wait_phase(kube, namespace, "broken-reward", "Failed", timeout=60)
    assert "label set is empty: check labelKey in the job" in job["status"]["message"]
    warnings = [e for e in events(kube, namespace, "broken-reward") if e["type"] == "Warning"]
    assert any("label set is empty" in e["message"] for e in warnings), warnings


def can_i(control_plane, namespace: str, account: str, *args: str) -> bool:
    result = control_plane.kubectl("auth", "can-i", "-n", namespace,
                                   "--as", f"system:serviceaccount:{namespace}:{account}", *args, check=False)
    return result.stdout.strip() == "yes"


def test_the_trainer_may_patch_its_own_status_and_nothing_else(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path):
    operator.start()
    control_plane.kubectl("-n", namespace, "create", "configmap", "letter-reward",
                          f"--from-file=reward.py={EXAMPLE.parent / 'tiny' / 'reward.py'}")
    for name in ("mine", "theirs"):
        control_plane.kubectl("-n", namespace, "apply", "-f",
                              str(tiny_job(tmp_path, tiny_model, "letter-reward", name=name)))
    job = wait_phase(kube, namespace, "mine", "Pending", timeout=60)
    rayjob = kube.get("RayJob", namespace, job["status"]["rayJobName"])
    account = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["serviceAccountName"]
    resource = f"{api.PLURAL}.{api.GROUP}"

    assert can_i(control_plane, namespace, account, "patch", f"{resource}/mine", "--subresource=status")
    assert can_i(control_plane, namespace, account, "get", f"{resource}/mine")
    assert not can_i(control_plane, namespace, account, "patch", f"{resource}/theirs", "--subresource=status")
    assert not can_i(control_plane, namespace, account, "patch", f"{resource}/mine")  # the spec
    assert not can_i(control_plane, namespace, account, "list", resource)
    assert not can_i(control_plane, namespace, account, "get", "secrets")
    assert not can_i(control_plane, namespace, account, "create", "pods")
    assert get_job(kube, namespace, "theirs")["status"]["phase"] == "Pending"
