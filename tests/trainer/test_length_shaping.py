"""Length shaping (DAPO, Yu et al. 2025, arXiv:2503.14476): the overlong buffer's soft penalty and the
truncation penalty, by hand and in a run; reward.clip bounding the shaped total; dynamic sampling and
evaluation looking at the task's own reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_api.v1alpha1 import DynamicSamplingSpec, EvaluationSpec, LengthShapingSpec
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.evaluation import Evaluation
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.rewards import build_reward
from rlhf_trainer.run import run
from rlhf_trainer.sampling import informative_groups, length_penalty, shape_rewards
from rlhf_trainer.tiny import build_tokenizer
from rlhf_trainer.workers.rollout import Completion


def test_the_overlong_buffer_penalty_is_dapo_s():
    """L_max 16, buffer 4, factor 2: no penalty up to 12 tokens, then -2 * (L - 12) / 4, -2 at 16 (DAPO eq. 13)."""
    spec = LengthShapingSpec(overlong_buffer_tokens=4, overlong_penalty=2.0)
    lengths = torch.tensor([0, 11, 12, 13, 14, 16])
    penalty = length_penalty(lengths, torch.zeros(6, dtype=torch.bool), 16, spec)
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0]


def test_the_truncation_penalty_hits_truncated_completions_only():
    spec = LengthShapingSpec(truncation_penalty=0.3)
    penalty = length_penalty(torch.tensor([16, 16, 3]), torch.tensor([True, False, False]), 16, spec)
    assert penalty.tolist() == pytest.approx([-0.3, 0.0, 0.0])
    assert not length_penalty(torch.tensor([16]), torch.tensor([True]), 16, LengthShapingSpec()).any()


def test_a_buffer_as_long_as_the_budget_is_refused():
    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "l"},
           "spec": {"algorithm": "grpo", "models": {"actor": {"path": "m"}},
                    "reward": {"sources": [{"name": "r", "type": "function", "function": {"entrypoint": "r.py:f"}}]},
                    "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}},
                    "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 8, "lengthShaping": {"overlongBufferTokens": 8}}}}
    with pytest.raises(InvalidJob, match="overlongBufferTokens must be smaller than maxNewTokens"):
        validate(job)


@pytest.mark.timeout(900)
def test_the_penalties_enter_the_reward_of_a_run(toy_job, local_ray, tmp_path):
    """The toy job's answers mostly run to maxNewTokens 8: each truncated one loses 0.5, and each reaching
    into the 4-token buffer loses up to 0.25 more. The reported penalty is that, and the total reward is
    the letter score plus it."""
    steps = 3
    job = toy_job(**{"training.maxSteps": steps, "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                     "rollout.lengthShaping": {"overlongBufferTokens": 4, "overlongPenalty": 0.25,
                                               "truncationPenalty": 0.5}})
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    for m in rows:
        truncation = -0.5 * m["truncated_fraction"]
        # A truncated answer has all 8 tokens: the full overlong penalty; others lose 0 to 0.25.
        most = truncation - 0.25 * m["truncated_fraction"]
        least = most - 0.25 * (1 - m["truncated_fraction"])
        assert least - 1e-6 <= m["reward/length_penalty"] <= most + 1e-6
        assert m["truncated_fraction"] > 0.5  # the penalties were exercised
        assert m["reward_mean"] == pytest.approx(m["reward/letter"] + m["reward/length_penalty"], abs=1e-5)


# -- shaping against the task's own reward ----------------------------------------------------------


def _shaping_job(tmp_path: Path, **spec):
    """A grpo job of maxNewTokens 16 whose one reward source, weight 1, scores each completion as its label
    says ("1" or "0"); `spec` adds sections. Returns the spec and the job's reward."""
    (tmp_path / "label.py").write_text("def score(prompts, completions, labels):\n    return [float(l) for l in labels]\n")
    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "s"},
           "spec": {"algorithm": "grpo", "models": {"actor": {"path": "m"}},
                    "reward": {"sources": [{"name": "task", "type": "function",
                                            "function": {"entrypoint": "label.py:score"}}]},
                    "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}},
                    "rollout": {"samplesPerPrompt": 2, "maxNewTokens": 16,
                                "lengthShaping": {"overlongBufferTokens": 4, "overlongPenalty": 1.0}}}}
    for section, value in spec.items():
        job["spec"].setdefault(section, {}).update(value)
    spec = validate(job).spec
    return spec, build_reward(spec.reward, base_dir=tmp_path)


def _scored(spec, reward, labels: list[str], samples: list[Completion]):
    return shape_rewards(reward.score(["p"] * len(labels), ["c"] * len(labels), labels), samples, spec)


CORRECT_12_AND_16 = [Completion([1] * 12, [0.0] * 12, False), Completion([1] * 16, [0.0] * 16, True)]


def test_dynamic_sampling_drops_an_all_correct_group_whatever_its_lengths(tmp_path):
    """Two correct answers of 12 and 16 tokens: the overlong buffer takes 1 off the longer one, but the
    group is all correct and trains nothing DAPO wants (it filters on accuracy)."""
    spec, reward = _shaping_job(tmp_path)
    result = _scored(spec, reward, ["1", "1"], CORRECT_12_AND_16)
    assert result.total.tolist() == [1.0, 0.0]  # trained on the shaped total
    assert informative_groups(result, 2, DynamicSamplingSpec(enabled=True)).tolist() == [False]


def test_evaluation_scores_the_unshaped_reward(tmp_path):
    """The same two correct answers both pass evaluation's threshold of 1, and their mean reward is 1."""
    spec, reward = _shaping_job(tmp_path)
    result = _scored(spec, reward, ["1", "1"], CORRECT_12_AND_16)
    (tmp_path / "e.jsonl").write_text('{"prompt": "p"}\n')
    evaluation = Evaluation(EvaluationSpec.model_validate({"datasets": [{"name": "e", "sources": [{"path": "e.jsonl"}]}],
                                                              "samplesPerPrompt": 2, "passK": 1, "temperature": 1.0}),
                            spec.data, build_tokenizer(), base_dir=tmp_path, seed=0)
    assert evaluation.metrics("e", result) == {"eval/e/mean_reward": 1.0, "eval/e/pass@1": 1.0}


def test_the_overlong_penalty_counts_the_policy_s_tokens_not_the_observations(tmp_path):
    """An episode of 8 policy tokens and 8 observation tokens is nowhere near the 4-token buffer."""
    spec, reward = _shaping_job(tmp_path)
    episode = Completion([1] * 16, [0.0] * 16, False, policy_mask=[True] * 4 + [False] * 8 + [True] * 4)
    assert _scored(spec, reward, ["1"], [episode]).by_source["length_penalty"].tolist() == [0.0]


def test_clip_bounds_the_total_with_the_environment_reward_and_the_length_penalty(tmp_path):
    """reward.clip 1: a source's 1 plus the environment's 2 is 1; a source's 0 minus the whole overlong
    penalty (1) and the truncation penalty (1) is -1."""
    spec, reward = _shaping_job(tmp_path, reward={"clip": 1.0},
                                rollout={"lengthShaping": {"overlongBufferTokens": 4, "overlongPenalty": 1.0,
                                                           "truncationPenalty": 1.0}},
                                environment={"type": "http", "http": {"url": "http://env"}})
    won = Completion([1] * 2, [0.0] * 2, False, env_reward=2.0)
    cut = Completion([1] * 16, [0.0] * 16, True)
    result = _scored(spec, reward, ["1", "0"], [won, cut])
    assert result.total.tolist() == [1.0, -1.0]
    assert result.by_source["environment"].tolist() == [2.0, 0.0]  # the sources are reported unclipped
