"""Jobs on PersistentVolumeClaims: a claim that is not Bound keeps the head pod from starting, and jobs
sharing one checkpoint claim each write under their own `<job name>/` and resume only from there.

Real control plane, operator and trainer; the head pods are played by e2e/pods/head.py, which
mounts a claim's local volume (e2e/storage.py) as a kubelet would.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from e2e.operator.jobs import wait_phase
from e2e.operator.tiny import reward_config_map, run_head, tiny_job
from e2e.pods.head import HeadPod
from e2e.storage import STORAGE_CLASS, VolumeNotReady, local_claim

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in the pod, on the shared claim


def assert_refused(head: HeadPod, match: str) -> None:
    """The head pod refuses to start, with that message (and is stopped if it started all the same)."""
    try:
        with pytest.raises(VolumeNotReady, match=match):
            head.start()
    finally:
        head.stop()


def test_a_head_pod_whose_claim_is_not_bound_does_not_start(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tmp_path):
    """Where a real pod would stay Pending, the pod runtime refuses to start (rather than let the
    host's filesystem stand in for the volume, as it once did)."""
    operator.start()
    job = tiny_job(tmp_path, "unbound", reward_config_map(control_plane, namespace),
                   actor={"path": "tiny", "pvc": {"claimName": "models"}})
    control_plane.kubectl("-n", namespace, "apply", "-f", str(job))
    ray_job = wait_phase(kube, namespace, "unbound", "Pending")["status"]["rayJobName"]

    assert_refused(HeadPod(control_plane, kube, kube_api.core, namespace, ray_job),
                   f"{namespace}/models does not exist")
    kube_api.core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": STORAGE_CLASS, "volumeName": "nowhere",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    assert_refused(HeadPod(control_plane, kube, kube_api.core, namespace, ray_job),
                   f"{namespace}/models is Pending, not Bound")


def steps_saved(directory: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("step-")) for path in directory.glob("step-*"))


def train(control_plane, kube, kube_api, namespace: str, tmp_path: Path, name: str, steps: int,
          model: Path, reward: str) -> tuple[dict[str, Any], str]:
    """Apply the job (a checkpoint every step, on the shared claim) and play its head pod to the end:
    the job's final status and the trainer's logs."""
    checkpoint = {"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": 1, "keep": 3, "exportHf": False}
    job = tiny_job(tmp_path, name, reward, actor={"path": str(model)}, steps=steps, checkpoint=checkpoint)
    control_plane.kubectl("-n", namespace, "apply", "-f", str(job))
    state, logs = run_head(control_plane, kube, kube_api, namespace, name)
    assert state == "SUCCEEDED", logs
    return wait_phase(kube, namespace, name, "Succeeded", timeout=60)["status"], logs


def test_jobs_sharing_a_checkpoint_claim_each_resume_only_their_own(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tmp_path):
    """Guards the operator's checkpoint mount (subPath: <job name>): without it every job writes at
    the volume's root, so job-b resumes from job-a's newest checkpoint, and `keep` of one prunes the
    other's. (A job resuming from its own checkpoint on a claim is test_multipod.py's.)"""
    from rlhf_trainer.tiny import build_tiny_model

    volume = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    model, reward = build_tiny_model(tmp_path / "model"), reward_config_map(control_plane, namespace)
    run = functools.partial(train, control_plane, kube, kube_api, namespace, tmp_path, model=model, reward=reward)

    run("job-a", steps=2)
    assert steps_saved(volume / "job-a") == [1, 2]

    # Another job on the same claim starts at step 0: job-a's step 2 is not its checkpoint.
    status, logs = run("job-b", steps=1)
    assert "resumed from" not in logs
    assert status["lastCheckpoint"]["step"] == 1 and status["lastCheckpoint"]["path"] == f"{CHECKPOINTS}/step-00000001"
    assert steps_saved(volume / "job-b") == [1]
    assert steps_saved(volume / "job-a") == [1, 2]
    assert sorted(path.name for path in volume.iterdir()) == ["job-a", "job-b"]
