"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476): groups whose rewards are all equal (or whose
mean is outside the range) are dropped, fresh prompts are sampled until the batch is full, and the
metrics say how many were dropped."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_api.v1alpha1 import DynamicSamplingSpec
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.data import PromptItem
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.rewards import RewardResult
from rlhf_trainer.run import run
from rlhf_trainer.sampling import Rollout, fill_batch, informative_groups
from rlhf_trainer.workers.rollout import Completion


def test_groups_with_equal_rewards_or_a_mean_outside_the_range_are_dropped():
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.2, 0.4, 0.5, 0.5])  # groups of 2
    rewards = RewardResult(rewards, {}, rewards)
    assert informative_groups(rewards, 2, DynamicSamplingSpec(enabled=True)).tolist() == [False, False, True, True, False]
    ranged = DynamicSamplingSpec(enabled=True, min_mean_reward=0.4, max_mean_reward=0.9)
    assert informative_groups(rewards, 2, ranged).tolist() == [False, False, True, False, False]


def _rollout(rewards: list[float], tag: str, length: int = 1) -> Rollout:
    prompts = [PromptItem(f"{tag}{i // 2}", [i]) for i in range(len(rewards))]
    samples = [Completion([i] * length, [0.0] * length, False) for i in range(len(rewards))]
    total = torch.tensor(rewards, dtype=torch.float32)
    return Rollout(prompts, samples, RewardResult(total, {"r": total.clone()}, total.clone()), 1.0)


def test_the_batch_takes_kept_groups_first_then_dropped_ones():
    first, second = _rollout([0, 0, 0, 1, 1, 1], "a"), _rollout([0, 1, 2, 2], "b")
    keep = [informative_groups(r.reward, 2, DynamicSamplingSpec(enabled=True)) for r in (first, second)]
    kept = [r.groups(k, 2) for r, k in zip((first, second), keep)]
    dropped = [r.groups(~k, 2) for r, k in zip((first, second), keep)]
    batch, refilled = fill_batch(kept, dropped, 3, 2)
    assert [p.prompt for p in batch.prompts] == ["a1", "a1", "b0", "b0", "a0", "a0"] and refilled == 1
    assert batch.reward.by_source["r"].tolist() == [0, 1, 0, 1, 0, 0] and batch.seconds == 2.0
    batch, refilled = fill_batch(kept, dropped, 1, 2)
    assert [p.prompt for p in batch.prompts] == ["a1", "a1"] and refilled == 0


def test_tokens_per_second_is_the_engines_throughput_over_every_round():
    """Two rounds of 1 second: the first's 4 one-token samples (one group kept, one dropped), the
    second's 4 of 3 tokens (both groups dropped); the batch is the kept group and the first dropped one.
    The engines sampled 16 tokens in 2 seconds: 8 tokens/s, not the batch's 4 tokens over 2 seconds."""
    from rlhf_trainer.experience import Experience
    from rlhf_trainer.trainer import Trainer

    first, second = _rollout([0, 1, 0, 0], "a"), _rollout([0, 0, 1, 1], "b", length=3)
    rounds = (first, second)
    keep = [informative_groups(r.reward, 2, DynamicSamplingSpec(enabled=True)) for r in rounds]
    batch, _ = fill_batch([r.groups(k, 2) for r, k in zip(rounds, keep)],
                          [r.groups(~k, 2) for r, k in zip(rounds, keep)], 2, 2)
    trainer = Trainer.__new__(Trainer)  # its real _pack and _rollout_metrics
    trainer.pad_token_id = 0
    sequences, attention_mask, action_mask = trainer._pack(batch.prompts, batch.samples)
    zeros = torch.zeros(action_mask.shape)
    experience = Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                            action_log_probs=zeros, rollout_log_probs=zeros, advantages=zeros,
                            response_length=action_mask.sum(-1))
    assert int(action_mask.sum()) == 4 and batch.seconds == 2.0
    assert trainer._rollout_metrics(experience, batch)["tokens_per_second"] == 8.0


def test_dynamic_sampling_is_refused_without_groups(tmp_path):
    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "d"},
           "spec": {"algorithm": "reinforce++", "models": {"actor": {"path": "m"}},
                    "reward": {"sources": [{"name": "r", "type": "function", "function": {"entrypoint": "r.py:f"}}]},
                    "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}},
                    "rollout": {"samplesPerPrompt": 1, "dynamicSampling": {"enabled": True, "minMeanReward": 1,
                                                                            "maxMeanReward": 0}}}}
    with pytest.raises(InvalidJob) as refused:
        validate(job)
    assert {e.path for e in refused.value.errors} == {"spec.rollout.dynamicSampling.enabled",
                                                      "spec.rollout.dynamicSampling.minMeanReward"}
    assert "set samplesPerPrompt to 2 or more" in str(refused.value)


# Only prompts asking for "a" (a quarter of the toy prompts) earn different rewards: 1 plus the fraction
# of a's in the answer. Every other group scores 0 for every sample, trains nothing and must be dropped.
MOSTLY_DEGENERATE = '''
def score(prompts, completions, labels):
    return [1.0 + sum(c == "a" for c in text) / max(len(text), 1) if label == "a" else 0.0
            for text, label in zip(completions, labels)]
'''


@pytest.mark.timeout(900)
def test_most_groups_degenerate_are_dropped_and_the_batch_is_filled(toy_job, local_ray, tmp_path, capsys):
    steps = 3
    job = toy_job(**{"training.maxSteps": steps, "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                     "rollout.dynamicSampling": {"enabled": True, "maxExtraRounds": 8},
                     "reward.sources": [{"name": "only-a", "type": "function",
                                         "function": {"entrypoint": "tiny/only_a.py:score"}}]})
    (job.parent / "tiny" / "only_a.py").write_text(MOSTLY_DEGENERATE)
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with capsys.disabled():
        for m in rows:
            print({k: round(v, 3) for k, v in m.items() if k.startswith(("dynamic", "reward_mean"))})
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    for m in rows:
        # A 16-prompt round has about 4 prompts asking for "a": the batch needed extra rounds ...
        assert m["dynamic_sampling/extra_rounds"] >= 2
        assert m["dynamic_sampling/dropped_groups"] >= 16 * m["dynamic_sampling/extra_rounds"] // 2
        # ... and holds only informative groups: every trained sample answers an "a" prompt (reward >= 1),
        # while the samples generated were mostly of other prompts (reward 0).
        assert m["dynamic_sampling/refilled_groups"] == 0
        assert m["reward_mean"] >= 1.0
        assert m["dynamic_sampling/sampled_reward_mean"] < 0.6


@pytest.mark.timeout(900)
def test_a_run_whose_extra_rounds_use_up_the_data_still_evaluates_after_its_last_step(toy_job, local_ray, tmp_path):
    """32 prompts, one pass, batches of 16: the first step's extra round takes the second batch, and the run
    ends after 1 of its 2 steps. The evaluation due after the last step runs after that one, with the
    best-checkpoint check; the baseline's evaluation time is step 0's, not step 1's; the kept fraction
    of the sampled groups is reported."""
    job = toy_job(**{"training.maxSteps": 2, "training.episodes": 1, "data.prompts.maxSamples": 32,
                     "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                     "rollout.dynamicSampling": {"enabled": True, "maxExtraRounds": 8},
                     "reward.sources": [{"name": "only-a", "type": "function",
                                         "function": {"entrypoint": "tiny/only_a.py:score"}}],
                     "evaluation": {"datasets": [{"name": "letters", "sources": [{"path": "tiny/prompts.jsonl"}],
                                                  "labelKey": "label", "maxSamples": 8}],
                                    "atStart": True, "bestMetric": "letters/mean_reward"}})
    (job.parent / "tiny" / "only_a.py").write_text(MOSTLY_DEGENERATE)
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [m for m in rows if "eval/letters/mean_reward" in m]
    assert [m["step"] for m in evaluations] == [0, 1]
    assert "eval/best/step" in evaluations[-1] and (out / "checkpoints" / "best" / "best.json").is_file()
    [trained] = [m for m in rows if "reward_mean" in m]
    assert "time/evaluation" in evaluations[0] and "time/evaluation" not in trained
    rounds = trained["dynamic_sampling/extra_rounds"] + 1
    assert rounds == 2
    assert trained["dynamic_sampling/kept_fraction"] == 1 - trained["dynamic_sampling/dropped_groups"] / (16 * rounds)
