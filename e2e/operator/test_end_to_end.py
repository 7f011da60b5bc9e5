"""The product's promise in one test: `kubectl apply` a job, watch it train, read its numbers in `kubectl get`.

The control plane, the operator and the trainer are real. No container runtime exists here, so
e2e/pods/head.py plays the head pod: it mounts the job's volumes where the pod spec says (its
ConfigMaps, its PersistentVolumeClaims bound to local volumes, a real ServiceAccount token), starts
a real Ray head, submits the RayJob's entrypoint through Ray's Jobs API and writes the RayJob
status KubeRay would (see that module for what it does not do).
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from e2e.operator.jobs import get_job, wait_events, wait_phase
from e2e.operator.tiny import reward_config_map, run_head, tiny_job
from e2e.storage import local_claim
from rlhf_api import v1alpha1 as api

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

STEPS = 3
CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in the pod, on the checkpoint claim


def test_kubectl_apply_trains_to_succeeded_with_numbers_in_kubectl_get(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path):
    """The model comes from one claim and the checkpoints go to another, as on a cluster.

    Guards the volumes end to end: the head pod mounting the models claim at its subPath (without
    it there is no model at /mnt/models/actor/tiny) and the operator mounting the checkpoint claim
    at the job's own directory (without that subPath the checkpoints land at the volume's root).
    """
    models = local_claim(kube_api.core, namespace, "models", tmp_path / "models-volume")
    shutil.copytree(tiny_model, models / "team-a" / "tiny")
    checkpoints = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    job_file = tiny_job(tmp_path, "tiny-grpo", reward_config_map(control_plane, namespace),
                        actor={"path": "tiny", "pvc": {"claimName": "models", "subPath": "team-a"}}, steps=STEPS,
                        checkpoint={"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": 2, "keep": 1})
    # Evaluation (spec.evaluation): a held-out set after step 2 and after the last step, the best actor kept.
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["evaluation"] = {
        "datasets": [{"name": "letters", "labelKey": "label", "maxSamples": 16,
                      "sources": manifest["spec"]["data"]["prompts"]["sources"]}],
        "intervalSteps": 2, "samplesPerPrompt": 1, "temperature": 0.0, "bestMetric": "letters/mean_reward"}
    job_file.write_text(yaml.safe_dump(manifest, sort_keys=False))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(job_file))

    state, logs = run_head(control_plane, kube, kube_api, namespace, "tiny-grpo")
    assert state == "SUCCEEDED", logs

    job = wait_phase(kube, namespace, "tiny-grpo", "Succeeded", timeout=60)
    status = job["status"]
    assert status["progress"]["step"] == STEPS and status["progress"]["summary"] == f"{STEPS}/{STEPS}"
    assert 0.0 <= status["metrics"]["rewardMean"] <= 1.0
    assert status["metrics"]["tokensPerSecond"] > 0
    assert status["lastCheckpoint"]["step"] == STEPS  # saved every 2 steps and at the end
    assert status["lastCheckpoint"]["path"] == f"{CHECKPOINTS}/step-{STEPS:08d}"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    assert status["startTime"] and status["completionTime"]

    # The evaluations: every one in metrics.jsonl (on the checkpoint volume), the last in the status.
    run_dir = checkpoints / "tiny-grpo"
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/letters/mean_reward" in row]
    assert [row["step"] for row in evals] == [2, STEPS]
    shown = yaml.safe_load(control_plane.kubectl("-n", namespace, "get", "rlhfjob", "tiny-grpo", "-o", "yaml").stdout)
    evaluation = shown["status"]["metrics"]["evaluation"]
    assert evaluation["letters/mean_reward"] == pytest.approx(evals[-1]["eval/letters/mean_reward"])
    assert evaluation["letters/pass@1"] == pytest.approx(evals[-1]["eval/letters/pass@1"])
    best = max(evals, key=lambda row: row["eval/letters/mean_reward"])  # the first of equals is kept
    assert evaluation["best/step"] == best["step"]
    assert json.loads((run_dir / "best" / "best.json").read_text())["step"] == best["step"]

    # On the volume, under the job's name: the newest checkpoint (keep: 1) and the exported model.
    assert [p.name for p in checkpoints.iterdir()] == ["tiny-grpo"]
    assert sorted(p.name for p in (checkpoints / "tiny-grpo").iterdir()) == ["best", "final", "logs", f"step-{STEPS:08d}"]
    assert (checkpoints / "tiny-grpo" / f"step-{STEPS:08d}" / "trainer_state.json").is_file()
    # TensorBoard beside them (checkpoint.path/logs): it outlives the head pod, every step and metric in it.
    events = EventAccumulator(str(run_dir / "logs" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == list(range(1, STEPS + 1))
    assert {"actor/grad_norm", "time/generation", "time/update", "time/weight_sync", "time/step"} <= set(
        events.Tags()["scalars"])

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
    reward = reward_config_map(control_plane, namespace, "broken-reward", broken)
    control_plane.kubectl("-n", namespace, "apply", "-f",
                          str(tiny_job(tmp_path, "broken-reward", reward, actor={"path": str(tiny_model)})))

    state, logs = run_head(control_plane, kube, kube_api, namespace, "broken-reward")
    assert state == "FAILED", logs

    job = wait_phase(kube, namespace, "broken-reward", "Failed", timeout=60)
    assert "label set is empty: check labelKey in the job" in job["status"]["message"]
    wait_events(kube, namespace, "broken-reward", lambda e: e["type"] == "Warning" and "label set is empty" in e["message"],
                "a warning quoting the reward function's error")


def can_i(control_plane, namespace: str, account: str, *args: str) -> bool:
    result = control_plane.kubectl("auth", "can-i", "-n", namespace,
                                   "--as", f"system:serviceaccount:{namespace}:{account}", *args, check=False)
    return result.stdout.strip() == "yes"


def test_the_trainer_may_patch_its_own_status_and_nothing_else(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path):
    operator.start()
    reward = reward_config_map(control_plane, namespace)
    for name in ("mine", "theirs"):
        control_plane.kubectl("-n", namespace, "apply", "-f",
                              str(tiny_job(tmp_path, name, reward, actor={"path": str(tiny_model)})))
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
