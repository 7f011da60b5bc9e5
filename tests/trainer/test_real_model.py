"""The real pretrained model (SmolLM2-135M-Instruct) through the whole trainer path: its example job
(manifests/examples/smollm2-grpo-cpu-job.yaml) for two short steps on CPU."""

from __future__ import annotations

import json

import pytest

from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run

pytestmark = pytest.mark.timeout(900)


def test_two_steps_of_the_real_model_s_example(smollm2_job, local_ray, tmp_path):
    job = smollm2_job(
        **{"training.maxSteps": 2, "training.rolloutBatchSize": 4, "rollout.samplesPerPrompt": 4,
           "training.trainBatchSize": 16, "training.microTrainBatchSize": 4, "rollout.maxNewTokens": 48,
           "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False, "evaluation": None})
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    first, second = (json.loads(line) for line in metrics_file.read_text().splitlines())
    # vLLM's sampling log-probs (temperature 0.7) and the trainer's of the same tokens agree: before
    # any update, and after step 1's update reached the engine through the weight sync.
    assert first["logprob_diff"] < 1e-4 and second["logprob_diff"] < 1e-4, (first, second)
    assert second["kl"] > 0  # the update did move the actor away from the reference
    # Completions end at the model's end of turn (<|im_end|>, the only stop) far more often than at
    # maxNewTokens: the instruct model answers a sum in a sentence.
    assert first["truncated_fraction"] < 0.5 and second["truncated_fraction"] < 0.5, (first, second)
    assert 0 < first["response_length"] < 48
