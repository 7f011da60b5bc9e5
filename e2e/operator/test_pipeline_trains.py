"""A two-stage pipeline trained for real through the operator (head pods played by e2e/pods/head.py, as in
test_end_to_end.py): both stages applied at once, the GRPO stage (models.reward.fromJob: the rm stage) waits,
then its head pod mounts the rm stage's directory of the checkpoint claim and learns from the reward model
found there. test_pipeline_example.py runs the example's four stages, where a stage trains on from the policy
its input exported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from e2e.operator.jobs import get_job, took, wait_phase
from e2e.operator.tiny import reward_config_map, run_head, tiny_job
from e2e.storage import local_claim

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in the pod, on the checkpoint claim
# The GRPO stage's steps and the rise of the task's 5-step mean reward it needs (tests/trainer/test_offline.py:
# the same stages measured 0.085 -> 0.446).
GRPO_STEPS, GRPO_GAIN = 10, 0.15


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "reward", kind="reward", seed=1)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_a_grpo_stage_learns_the_task_from_the_reward_model_the_stage_it_names_trained(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tiny_reward_model, tmp_path,
        capsys):
    """RM -> GRPO: the GRPO stage's reward group loads the reward model the rm stage trained (models.reward.fromJob,
    from the checkpoint claim), its only reward that counts. The task's own reward, a source weighted 1e-6 that
    only watches, rises: what the GRPO stage loaded is the trained model, as an untrained one has no reason to
    prefer the letter (tests/trainer/test_offline.py measures both)."""
    from rlhf_trainer.tiny import one_letter_task

    models = local_claim(kube_api.core, namespace, "models", tmp_path / "models-volume")
    shutil.copytree(tiny_model, models / "tiny")
    shutil.copytree(tiny_reward_model, models / "reward")
    checkpoints = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    asked, pairs = one_letter_task("a")
    on_the_claim = {"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": 0, "exportHf": True}
    grpo = tiny_job(tmp_path, "letters-grpo", reward_config_map(control_plane, namespace),
                    actor={"path": "tiny", "pvc": {"claimName": "models"}}, steps=GRPO_STEPS, checkpoint=on_the_claim)
    manifest = yaml.safe_load(grpo.read_text())
    spec = manifest["spec"]
    spec["data"]["prompts"]["sources"][0]["path"] = str(_jsonl(tmp_path / "asked.jsonl", asked))
    spec["models"]["reward"] = {"fromJob": {"name": "letters-rm"}, "dtype": "float32"}
    letter = spec["reward"]["sources"][0]
    spec["reward"]["sources"] = [{"name": "rm", "type": "model"}, {**letter, "weight": 1e-6}]
    grpo.write_text(yaml.safe_dump(manifest, sort_keys=False))
    rm = {**manifest, "metadata": {"name": "letters-rm"}, "spec": {
        "algorithm": "rm",
        "models": {"actor": {"path": "reward", "pvc": {"claimName": "models"}, "dtype": "float32"}},
        "data": {"preferences": {"sources": [{"path": str(_jsonl(tmp_path / "pairs.jsonl", pairs))}]},
                 "maxPromptTokens": 48, "maxTokens": 64},
        "training": {"zeroStage": 2, "bf16": False, "learningRate": 1.0e-3, "lrWarmupRatio": 0.0,
                     "lrScheduler": "constant", "trainBatchSize": 16, "microTrainBatchSize": 8, "epochs": 1,
                     "maxSteps": 16, "seed": 42},
        "resources": spec["resources"], "checkpoint": on_the_claim}}
    (tmp_path / "letters-rm.yaml").write_text(yaml.safe_dump(rm, sort_keys=False))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(grpo), "-f", str(tmp_path / "letters-rm.yaml"))

    wait_phase(kube, namespace, "letters-grpo", "Waiting", "WaitingForJob")
    state, logs = run_head(control_plane, kube, kube_api, namespace, "letters-rm")
    assert state == "SUCCEEDED", logs
    exported = wait_phase(kube, namespace, "letters-rm", "Succeeded", timeout=60)["status"]["outputModel"]
    assert exported["kind"] == "reward" and exported["subPath"] == "letters-rm", exported

    state, logs = run_head(control_plane, kube, kube_api, namespace, "letters-grpo")
    assert state == "SUCCEEDED", logs
    metrics = [json.loads(line) for line in
               (checkpoints / "letters-grpo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    task = [m[f"reward/{letter['name']}"] for m in metrics]
    seconds = {name: took(get_job(kube, namespace, name)) for name in ("letters-rm", "letters-grpo")}
    with capsys.disabled():
        print(f"\npipeline rm -> grpo: task reward per step {[round(r, 3) for r in task]}; seconds from each "
              f"stage's start to its completion {seconds}")
    assert len(task) == GRPO_STEPS and sum(task[-5:]) / 5 > sum(task[:5]) / 5 + GRPO_GAIN, task
