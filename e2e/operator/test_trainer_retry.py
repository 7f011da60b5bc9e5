"""A model worker SIGKILLed under the operator, with backoffLimit 1: KubeRay's retry resumes the run
from its newest checkpoint on the claim, and the RLHFJob says which attempt it is on.

Real control plane, operator and trainer. The head pods are played by e2e/pods/head.py, which
also does KubeRay's part of the retry as KubeRay v1.6 does it (the RayJob Running -> Retrying ->
New -> Initializing with a new cluster and submission id, status.failed counting attempts; see
e2e/operator/kuberay.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import watch
from urllib3.exceptions import ProtocolError

from e2e.operator.jobs import wait_events, wait_phase
from e2e.operator.tiny import reward_config_map, tiny_job
from e2e.pods.head import HeadPod
from e2e.storage import local_claim
from rlhf_api import v1alpha1 as api
from tests.trainer.run_probes import newest, ray_actor_pids

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

STEPS, INTERVAL = 8, 2
CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in the pod, on the checkpoint claim


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def kill_a_model_worker_past_a_checkpoint(head: HeadPod, run_dir: Path, killed: list[int],
                                          timeout: float = 600) -> None:
    """SIGKILL one ModelWorker once a step after the newest checkpoint on the claim is logged: that step is lost."""
    deadline = time.monotonic() + timeout
    while (saved := newest(run_dir)) is None or max(steps_logged(run_dir), default=0) <= saved:
        if time.monotonic() > deadline or head.process.poll() is not None:
            return
        time.sleep(0.1)
    workers = ray_actor_pids(head.process, "ModelWorker")  # the head runs in a session of its own
    if workers:
        os.kill(workers[0], signal.SIGKILL)
        killed.append(workers[0])


class StatusHistory:
    """Every status the RLHFJob is given, in the API server's order (a watch, so none is missed)."""

    def __init__(self, control_plane, namespace: str, name: str):
        from kubernetes import client

        self.api_client = control_plane.api_client()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.namespace, self.name = namespace, name
        self.seen: list[dict] = []
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for event in self.watch.stream(self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION,
                                           self.namespace, api.PLURAL, field_selector=f"metadata.name={self.name}"):
                status = event["object"].get("status") or {}
                if status.get("phase") and (not self.seen or self.seen[-1] != status):
                    self.seen.append(status)
        except ProtocolError:  # stop() closed the connection under the stream
            pass

    def stop(self) -> list[dict]:
        self.watch.stop()
        self.thread.join(10)
        self.api_client.close()
        return self.seen


def test_a_killed_model_worker_is_retried_and_resumes_from_the_checkpoint_on_the_claim(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tmp_path):
    from rlhf_trainer.tiny import build_tiny_model

    volume = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    run_dir = volume / "retried"
    operator.start()
    job_file = tiny_job(tmp_path, "retried", reward_config_map(control_plane, namespace),
                        actor={"path": str(build_tiny_model(tmp_path / "model"))}, steps=STEPS,
                        checkpoint={"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": INTERVAL, "keep": 2,
                                    "exportHf": False})
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["backoffLimit"] = 1
    job_file.write_text(yaml.safe_dump(manifest, sort_keys=False))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(job_file))
    history = StatusHistory(control_plane, namespace, "retried")
    ray_job = wait_phase(kube, namespace, "retried", "Pending")["status"]["rayJobName"]

    # Attempt 1: a model worker dies a step past a checkpoint on the claim; the Ray job fails.
    head = HeadPod(control_plane, kube, kube_api.core, namespace, ray_job).start()
    try:
        first_cluster = wait_phase(kube, namespace, "retried", "Provisioning")["status"]["rayClusterName"]
        killed: list[int] = []
        killer = threading.Thread(target=kill_a_model_worker_past_a_checkpoint, args=(head, run_dir, killed))
        killer.start()
        state, logs = head.run_job()
        killer.join()
        assert killed, f"no ModelWorker was killed (the run ended first?):\n{logs[-4000:]}"
        assert state == "FAILED", logs[-4000:]
        assert "the run failed: ActorDiedError" in logs, logs[-4000:]
        saved, logged = newest(run_dir), steps_logged(run_dir)
        assert saved is not None and saved < STEPS and max(logged) - saved <= INTERVAL, (saved, logged)

        # KubeRay has attempts left: the RayJob is Retrying (never Failed), and so is the RLHFJob.
        retrying = wait_phase(kube, namespace, "retried", "Provisioning", "Retrying", timeout=60)["status"]
        assert retrying["message"].startswith("Attempt 2 of 2 (1 failed): ") and "ActorDiedError" in retrying["message"]

        # Attempt 2 on a new Ray cluster: the trainer resumes from the newest checkpoint on the claim.
        first_submission = head.job_id
        head = head.retry()
        second_cluster = wait_phase(kube, namespace, "retried", "Provisioning", "StartingRayCluster")[
            "status"]["rayClusterName"]
        state, logs = head.run_job()
    finally:
        head.stop()
        seen = history.stop()
    assert state == "SUCCEEDED", logs[-4000:]
    assert f"resumed from {CHECKPOINTS}/step-{saved:08d} at step {saved}" in logs, logs[-4000:]
    assert steps_logged(run_dir)[len(logged):] == list(range(saved + 1, STEPS + 1))
    print(f"\ntrainer retry: a ModelWorker SIGKILLed after step {max(logged)} of {STEPS}; attempt 2 resumed from "
          f"the step-{saved} checkpoint on the claim: {max(logged) - saved} steps lost (interval {INTERVAL})")
    assert newest(run_dir) == STEPS and second_cluster != first_cluster
    ray_status = kube.get("RayJob", namespace, ray_job)["status"]
    assert (ray_status["failed"], ray_status["succeeded"]) == (1, 1)
    assert ray_status["jobId"] == head.job_id != first_submission  # a new submission id, as KubeRay draws

    status = wait_phase(kube, namespace, "retried", "Succeeded", timeout=60)["status"]
    assert status["progress"]["step"] == STEPS and status["lastCheckpoint"]["step"] == STEPS
    seen = [s for s in seen if s["phase"] != "Succeeded"] + [status]
    # Running -> Retrying (attempt 2 of 2) -> ... -> Succeeded, every message of attempt 2 saying so,
    # one startTime from the first attempt to the end (KubeRay restarts its own with each attempt).
    reasons = [s["reason"] for s in seen]
    assert reasons.index("Training") < reasons.index("Retrying") < len(reasons) - 1 - reasons[::-1].index("Training")
    assert reasons[-1] == "Completed", reasons
    retried = seen[reasons.index("Retrying"):-1]
    assert all(s["message"].startswith("Attempt 2 of 2 (1 failed): ") for s in retried), [s["message"] for s in retried]
    assert len({s.get("startTime") for s in seen if s["phase"] != "Pending"}) == 1, [s.get("startTime") for s in seen]
    assert status["startTime"] == retrying["startTime"]

    # The failed attempt is a Warning event that names what failed and which attempt comes next.
    wait_events(kube, namespace, "retried", lambda e: e["type"] == "Warning" and e["reason"] == "Retrying"
                and e["message"].startswith("Attempt 2 of 2") and "ActorDiedError" in e["message"],
                "a Retrying warning naming the ActorDiedError")
