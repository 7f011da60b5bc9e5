"""The tiny CPU GRPO example (manifests/examples/tiny-grpo-cpu-job.yaml) as an RLHFJob of a test, run for real.

Its head pod is played on this machine by e2e/pods/head.py; a run of a few steps takes 1-2 minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from e2e.operator.jobs import wait_phase
from e2e.pods.head import HeadPod

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "manifests" / "examples" / "tiny-grpo-cpu-job.yaml"
LETTER_REWARD = EXAMPLE.parent / "tiny" / "reward.py"


def reward_config_map(control_plane, namespace: str, name: str = "letter-reward", code: Path = LETTER_REWARD) -> str:
    control_plane.kubectl("-n", namespace, "create", "configmap", name, f"--from-file=reward.py={code}")
    return name


def tiny_job(directory: Path, name: str, reward_config_map: str, actor: dict[str, Any], steps: int = 3,
             checkpoint: dict[str, Any] | None = None) -> Path:
    """The example as one would ship it to a cluster: absolute paths (the "image"), the reward from a ConfigMap.

    actor: models.actor fields (a path, and a pvc); checkpoint: spec.checkpoint, by default every 2
    steps into a directory of this machine (no volume).
    """
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    job["metadata"]["name"] = name
    spec["models"]["actor"].update(actor)
    spec["data"]["prompts"]["sources"][0]["path"] = str(EXAMPLE.parent / "tiny" / "prompts.jsonl")
    spec["reward"]["sources"][0]["function"] = {"entrypoint": "reward.py:score", "configMap": reward_config_map}
    spec["training"]["maxSteps"] = steps
    spec["checkpoint"] = checkpoint or {"path": str(directory / "checkpoints" / name), "intervalSteps": 2, "keep": 1}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_head(control_plane, kube, kube_api, namespace: str, job_name: str) -> tuple[str, str]:
    """Play the job's head pod until its Ray job ends: (the Ray job's state, its logs)."""
    job = wait_phase(kube, namespace, job_name, "Pending", timeout=60)
    head = HeadPod(control_plane, kube, kube_api.core, namespace, job["status"]["rayJobName"])
    try:
        head.start()
        return head.run_job()
    finally:
        head.stop()
