"""The example pipeline (manifests/examples/pipeline/: SFT -> reward model -> PPO against it, and DPO beside
them) applied at once with kubectl and trained through the operator, the hub played offline and each stage cut
to two steps (e2e/hub.py), its head pods played by e2e/pods/head.py (as in test_end_to_end.py). The tiny model
stands for the examples' SmolLM2-135M-Instruct: what this test is about is the stages' order, each stage's
models coming from the claim of the stage it names and every algorithm running through the operator, not the
weights (four stages of the real model took 12 minutes of the suite's two cores). The real model trains in
tests/trainer/test_real_model.py; `rlhf run DIR`'s pipelines (the same trainer code) are
tests/trainer/test_offline.py's."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from e2e import hub
from e2e.operator.jobs import get_job, took, wait_phase
from e2e.operator.tiny import run_head
from e2e.storage import local_claim
from rlhf_api import contract
from rlhf_api.validation import validate

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)


def test_the_example_pipeline_applied_at_once_trains_each_stage_after_its_inputs_from_their_models(
        control_plane, kube, kube_api, namespace, operator, kuberay_paused, tiny_model, tmp_path, capsys):
    checkpoints = local_claim(kube_api.core, namespace, "rlhf-checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    files = hub.example_pipeline(tmp_path / "pipeline", tiny_model, hub.PIPELINE_STEPS)
    control_plane.kubectl("-n", namespace, "apply", "-f", str(tmp_path / "pipeline"))

    for stage in ("pipeline-rm", "pipeline-dpo", "pipeline-ppo"):
        waiting = wait_phase(kube, namespace, stage, "Waiting", "WaitingForJob")["status"]
        assert "RLHFJob pipeline-sft (models.actor) " in waiting["message"], waiting
    logs = {}
    for stage in ("pipeline-sft", "pipeline-rm", "pipeline-dpo", "pipeline-ppo"):
        if stage == "pipeline-rm":  # SFT's success starts rm and dpo; ppo waits on for rm
            ppo = wait_phase(kube, namespace, "pipeline-ppo", "Waiting", "WaitingForJob")["status"]
            assert "RLHFJob pipeline-rm (models.reward) is " in ppo["message"], ppo
        state, logs[stage] = run_head(control_plane, kube, kube_api, namespace, stage)
        assert state == "SUCCEEDED", logs[stage]
        output = wait_phase(kube, namespace, stage, "Succeeded", timeout=60)["status"]["outputModel"]
        assert output["subPath"] == stage and output["step"] == hub.PIPELINE_STEPS, output
        assert {p.name for p in (checkpoints / stage).iterdir()} == {"final", "logs"}, "keep 0: the export alone"
    seconds = {stage: took(get_job(kube, namespace, stage)) for stage in logs}
    with capsys.disabled():
        print(f"\nthe example pipeline through the operator, seconds from each stage's start to its completion: {seconds}")

    # Each role's model came from the claim's directory of the stage its fromJob names: the stage's
    # status.inputs name that job for the role's field, and the trainer said it loaded that field's mount.
    specs = {path.stem.split("-", 1)[1]: validate(yaml.safe_load(path.read_text())).spec for path in files}
    for stage, roles in hub.PIPELINE_LOADS.items():
        inputs = {i["role"]: i for i in get_job(kube, namespace, stage)["status"]["inputs"]}
        for role, source in roles.items():
            field, _ = specs[stage.removeprefix("pipeline-")].models.source(role)
            assert inputs[field]["name"] == source and inputs[field]["phase"] == "Succeeded", (stage, role, inputs)
            assert f"the {role} model loads from {contract.model_on_pvc(field, 'final')}" in logs[stage], (stage, role)
    def metrics(stage: str) -> list[dict]:
        return [json.loads(line) for line in (checkpoints / stage / contract.LOGS_DIR / "metrics.jsonl").open()]

    ppo = metrics("pipeline-ppo")
    assert len(ppo) == hub.PIPELINE_STEPS and all("reward/rm" in m for m in ppo), ppo
    # DPO's step 1 scores the policy before its update, where it equals the reference (both SFT's model):
    # no margin, loss log 2.
    dpo_first = metrics("pipeline-dpo")[0]
    assert abs(dpo_first["reward_margin"]) < 1e-3 and dpo_first["loss"] == pytest.approx(math.log(2), abs=1e-3), dpo_first
    # What DPO trained from: SFT's model, not the base. SFT's two steps at lr 1e-5 moved the weights about
    # 20 times as far as DPO's two at 5e-7 (Adam: about lr per weight per step).
    dpo = checkpoints / "pipeline-dpo" / "final"
    assert hub.weights_distance(dpo, checkpoints / "pipeline-sft" / "final") * 5 < hub.weights_distance(dpo, tiny_model)
