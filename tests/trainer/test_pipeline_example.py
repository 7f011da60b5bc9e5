"""The example pipeline (manifests/examples/pipeline/: SFT -> reward model -> PPO against it, and DPO beside
them, on SmolLM2-135M-Instruct) run by `rlhf run` of its directory, as a user runs it on one machine: the hub
played offline and each stage cut to two steps (e2e/hub.py). e2e/operator/test_pipeline_example.py runs the
same files through the operator."""

from __future__ import annotations

import json
import logging
import time

import pytest
from e2e import hub
from rlhf_trainer.run import run_pipeline

pytestmark = pytest.mark.timeout(1200)

def test_the_example_pipeline_runs_each_stage_from_the_models_of_the_stages_it_names(smollm2, local_ray, tmp_path,
                                                                                        caplog, capsys):
    hub.example_pipeline(tmp_path / "pipeline", hub.PIPELINE_STEPS, checkpoints="checkpoints")
    out = tmp_path / "runs"
    caplog.set_level(logging.INFO, logger="rlhf_trainer")
    started = time.monotonic()
    assert run_pipeline([tmp_path / "pipeline"], output_dir=out) == 0
    with capsys.disabled():
        print(f"\nthe example pipeline, 4 stages of {hub.PIPELINE_STEPS} steps: {time.monotonic() - started:.0f} s")

    def final(stage: str):
        return out / stage / "checkpoints" / "final"

    # Each stage's models came from the final model of the stage its fromJob names, as it said at its start:
    # the stages ran in dependency order (sft first; rm, ppo, dpo in name order after their inputs).
    loaded = [record.getMessage() for record in caplog.records if record.getMessage().startswith("the ")]
    for stage, roles in hub.PIPELINE_LOADS.items():
        for role, source in roles.items():
            assert f"the {role} model loads from {final(source)}" in loaded, (stage, role, loaded)
    for stage in ("pipeline-sft", "pipeline-rm", "pipeline-ppo", "pipeline-dpo"):
        metrics = [json.loads(line) for line in (out / stage / "checkpoints" / "logs" / "metrics.jsonl").open()]
        assert [m["step"] for m in metrics] == list(range(1, hub.PIPELINE_STEPS + 1)), stage
        # checkpoint.keep 0: the export, and no step's checkpoint
        assert {p.name for p in (out / stage / "checkpoints").iterdir()} == {"final", "logs"}, stage
    assert all("reward/rm" in m for m in map(json.loads, (out / "pipeline-ppo/checkpoints/logs/metrics.jsonl").open()))

    # What DPO trained from: SFT's model, not the base. SFT's two steps at lr 1e-5 moved the weights about
    # 20 times as far as DPO's two at 5e-7 (Adam: about lr per weight per step).
    dpo = final("pipeline-dpo")
    from_sft, from_base = hub.weights_distance(dpo, final("pipeline-sft")), hub.weights_distance(dpo, smollm2)
    with capsys.disabled():
        print(f"the DPO stage's model: {from_sft:.4f} from SFT's, {from_base:.4f} from the base model")
    assert from_sft * 5 < from_base
