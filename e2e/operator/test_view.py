"""`rlhf status|logs|tensorboard JOB` as a user runs them (a subprocess with a kubeconfig), against the
test world's API server.

pods/log: the API server asks the pod's kubelet for the log; kwok's nodes have none, so here `rlhf logs`
is tested up to that seam (it finds the trainer's pod, asks pods/log for it, and says what the API server
answered); test_multipod.py follows a real run's log through the pod runtime's kubelet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from e2e.fixtures import wait_for
from e2e.operator.conftest import REPO
from e2e.operator.jobs import create_job, rlhf_job
from rlhf_api import v1alpha1 as api

CPU_NODE = "kwok-cpu-0"


def rlhf(control_plane, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_cli.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=control_plane.env(dict(os.environ)), timeout=120)


def test_status_shows_phase_progress_checkpoint_usage_and_metrics(control_plane, kube, namespace):
    create_job(kube, namespace, rlhf_job("seen"))
    kube.patch(api.KIND, namespace, "seen", {"status": {
        "phase": "Running", "reason": "Training", "message": "Training on Ray cluster seen-abcde",
        "progress": {"step": 3, "totalSteps": 10, "percent": 30.0, "summary": "3/10", "etaSeconds": 420},
        "metrics": {"rewardMean": 0.25, "kl": 0.0125, "evaluation": {"gsm8k/mean_reward": 0.5}},
        "lastCheckpoint": {"step": 2, "path": "/checkpoints/step-2", "time": "2026-11-24T20:00:00Z"},
        "usage": {"gpuSeconds": 7200, "cpuSeconds": 1800.0, "gpuHours": 2.0, "countedUntil": "2026-11-24T20:01:00Z",
                  "attempts": [{"rayClusterName": "seen-abcde", "gpuSeconds": 7200, "cpuSeconds": 1800.0, "pods": []}]},
    }}, subresource="status")
    shown = rlhf(control_plane, "status", "seen", "-n", namespace)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[:2] == [f"RLHFJob {namespace}/seen (sft)", "Phase:      Running (Training)"]
    assert "Progress:   step 3/10 (30%), about 7m00s left" in lines
    assert "Checkpoint: step 2 at /checkpoints/step-2 (2026-11-24T20:00:00Z)" in lines
    assert "Usage:      2.00 GPU-hours, 0.50 CPU-hours (up to 2026-11-24T20:01:00Z)" in lines
    assert "  attempt 1: seen-abcde, 0 pods, 2.00 GPU-hours" in lines
    assert lines[lines.index("Metrics:") + 1:] == ["  gsm8k/mean_reward  0.5", "  kl                 0.0125",
                                                   "  rewardMean         0.25"]

    missing = rlhf(control_plane, "status", "nosuchjob", "-n", namespace)
    assert missing.returncode != 0 and f"no RLHFJob nosuchjob in namespace {namespace}" in missing.stderr


def test_status_shows_a_pipeline_stage_s_lineage(control_plane, kube, namespace):
    create_job(kube, namespace, rlhf_job("sft", checkpoint={"pvc": "stages"}))
    dpo = rlhf_job("dpo", algorithm="dpo", models={"actor": {"fromJob": {"name": "sft"}}},
                   data={"preferences": {"sources": [{"path": "org/pairs"}]}})
    create_job(kube, namespace, dpo)
    kube.patch(api.KIND, namespace, "sft", {"status": {"phase": "Succeeded", "outputModel": {
        "claimName": "stages", "subPath": "sft", "final": "final", "kind": "policy", "step": 3}}}, subresource="status")
    kube.patch(api.KIND, namespace, "dpo", {"status": {"phase": "Waiting", "inputs": [
        {"role": "actor", "name": "sft", "uid": "u", "phase": "Succeeded"}]}}, subresource="status")

    source = rlhf(control_plane, "status", "sft", "-n", namespace)
    assert source.returncode == 0, source.stderr
    assert "Output:     policy model on claim stages at sft/final" in source.stdout.splitlines()
    assert "Used by:    RLHFJob dpo (models.actor, Waiting)" in source.stdout.splitlines()
    stage = rlhf(control_plane, "status", "dpo", "-n", namespace)
    assert "From:       models.actor <- RLHFJob sft (Succeeded), its final model" in stage.stdout.splitlines()


def test_logs_asks_pods_log_for_the_trainer_pod(control_plane, kube, namespace, kwok_nodes):
    create_job(kube, namespace, rlhf_job("logged"))
    none_yet = rlhf(control_plane, "logs", "logged", "-n", namespace)
    assert none_yet.returncode == 1 and "has no trainer pod now" in none_yet.stderr

    # The submitter pod as KubeRay makes it from our template (its labels), running on a kwok node.
    kube._request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "logged-submitter", "labels": {"rlhf.dev/job": "logged", "rlhf.dev/role": "submitter"}},
        "spec": {"nodeName": CPU_NODE, "containers": [{"name": "ray-job-submitter", "image": "rayproject/ray"}]}})
    wait_for(lambda: kube._request("GET", f"/api/v1/namespaces/{namespace}/pods/logged-submitter")
             .get("status", {}).get("phase") == "Running", 60, "kwok to run the pod")
    logs = rlhf(control_plane, "logs", "logged", "-n", namespace)
    assert "==> pod logged-submitter" in logs.stdout
    # The seam: kwok's node has no kubelet to serve the log.
    assert logs.returncode == 1 and "could not serve the log of pod logged-submitter" in logs.stderr, logs


def test_tensorboard_draws_the_curves_of_the_runs_metrics_file(control_plane, kube, namespace, tmp_path):
    (tmp_path / "logs").mkdir()
    steps = [{"step": s, "time": 0, "reward_mean": r, "kl": 0.01 * s} for s, r in enumerate([0.0, 0.5, 1.0], 1)]
    # A resumed run appends from its checkpoint: step 3 again, the last record wins.
    steps.append({"step": 3, "time": 0, "reward_mean": 0.75, "kl": 0.03})
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    create_job(kube, namespace, rlhf_job("curves", checkpoint={"path": str(tmp_path)}))

    shown = rlhf(control_plane, "tensorboard", "curves", "-n", namespace)
    assert shown.returncode == 0, shown.stderr
    assert "  reward_mean  ▁▆█  last 0.75" in shown.stdout.splitlines()
    assert f"TensorBoard: tensorboard --logdir {tmp_path / 'logs' / 'tensorboard'}" in shown.stdout

    elsewhere = rlhf(control_plane, "tensorboard", "curves", "--logdir", str(tmp_path / "nothing"))
    assert elsewhere.returncode == 1 and "metrics.jsonl does not exist: pass --logdir" in elsewhere.stderr
