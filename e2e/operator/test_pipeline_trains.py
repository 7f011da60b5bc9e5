"""A two-stage pipeline trained for real through the operator (head pods played by e2e/pods/head.py, as in
test_end_to_end.py): both stages applied at once, the second (models.actor.fromJob: the first) waits,
then its head pod mounts the first stage's directory of the checkpoint claim and trains on from the
model the first stage exported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from e2e.operator.jobs import get_job, wait_phase
from e2e.operator.tiny import reward_config_map, run_head, tiny_job
from e2e.storage import local_claim

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in the pod, on the checkpoint claim


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _distance(a: Path, b: Path) -> float:
    """The L2 distance between two exported models' weights."""
    first, second = (AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (a, b))
    return sum(float((first[name] - second[name]).float().pow(2).sum()) for name in first) ** 0.5


def test_a_stage_trains_on_from_the_model_the_stage_it_names_exported(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path, capsys):
    models = local_claim(kube_api.core, namespace, "models", tmp_path / "models-volume")
    shutil.copytree(tiny_model, models / "team-a" / "tiny")
    checkpoints = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    reward = reward_config_map(control_plane, namespace)
    on_the_claim = {"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": 0}
    first = tiny_job(tmp_path, "first", reward, actor={"path": "tiny", "pvc": {"claimName": "models", "subPath": "team-a"}},
                     steps=3, checkpoint=on_the_claim)
    second = tiny_job(tmp_path, "second", reward, actor={}, steps=1, checkpoint=on_the_claim)
    manifest = yaml.safe_load(second.read_text())
    manifest["spec"]["models"]["actor"] = {"fromJob": {"name": "first"}, "dtype": "float32"}
    second.write_text(yaml.safe_dump(manifest, sort_keys=False))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(second), "-f", str(first))

    wait_phase(kube, namespace, "second", "Waiting", "WaitingForJob")
    state, logs = run_head(control_plane, kube, kube_api, namespace, "first")
    assert state == "SUCCEEDED", logs
    exported = wait_phase(kube, namespace, "first", "Succeeded", timeout=60)["status"]["outputModel"]
    assert exported == {"claimName": "checkpoints", "subPath": "first", "final": "final", "kind": "policy", "step": 3}

    state, logs = run_head(control_plane, kube, kube_api, namespace, "second")
    assert state == "SUCCEEDED", logs
    assert get_job(kube, namespace, "second")["status"]["inputs"][0]["phase"] == "Succeeded"
    # What the second stage trained from: its final model is one update (Adam, lr 5e-3: about lr per weight)
    # from the first stage's and four from the base model. Had it started from the base, it would be one
    # from the base and four from the first stage's.
    trained_on = _distance(checkpoints / "second" / "final", checkpoints / "first" / "final")
    from_base = _distance(checkpoints / "second" / "final", tiny_model)
    with capsys.disabled():
        print(f"\npipeline: the second stage's model is {trained_on:.3f} from the first's, {from_base:.3f} from the base")
    assert trained_on < from_base, (trained_on, from_base)
