"""The online algorithms learn the toy task (tiny example job, CPU): the mean reward of the last
five steps beats the first five by a margin far beyond step-to-step noise (about 0.03 at the
start, where the reward itself is about 0.03)."""

from __future__ import annotations

import json

import pytest

from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run

pytestmark = pytest.mark.timeout(900)

# algorithm -> (spec overrides, steps, required gain of the 5-step mean reward)
CASES = {
    "grpo": ({}, 30, 0.1),
    # ZeRO-3 for the actor, the critic (a value head on the actor) and the reference, which shares
    # the actor's bundle.
    "ppo": ({"training.zeroStage": 3, "training.criticLearningRate": 5.0e-3, "training.colocation": "actor-reference"},
            30, 0.1),
    "reinforce++": ({"rollout.samplesPerPrompt": 4, "training.rolloutBatchSize": 32}, 20, 0.03),
    # Rollouts generated one update ahead of training.
    "rloo": ({"training.asyncQueueSize": 1}, 20, 0.03),
}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("algorithm", CASES)
def test_reward_rises(algorithm, toy_job, local_ray, tmp_path, capsys):
    overrides, steps, gain = CASES[algorithm]
    job = toy_job(**{"algorithm": algorithm, "training.maxSteps": steps, "training.episodes": 3,
                     "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False, **overrides})
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0

    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics]
    with capsys.disabled():
        print(f"\n{algorithm}: mean reward per step {[round(r, 3) for r in rewards]}")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert _mean(rewards[-5:]) > _mean(rewards[:5]) + gain, rewards

    # The weight sync, checked at every step: vLLM's log-probs of what it sampled are the actor's.
    # With asynchronous rollouts the engines are one update behind by design.
    drift = [m["logprob_diff"] for m in metrics[1:]]
    if overrides.get("training.asyncQueueSize"):
        assert min(drift) > 1e-4, drift
    else:
        assert max(drift) < 1e-4, drift
