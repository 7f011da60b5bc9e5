"""A 2-process ZeRO-3 actor group on CPU: parameters stay identical across ranks and match 1 process."""

from __future__ import annotations

import pytest
import ray
import torch

from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import ModelSpec, StepReward, TrainingSpec
from rlhf_trainer.experience import Experience
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, mean_metrics
from rlhf_trainer.workers.engine import ModelConfig

pytestmark = pytest.mark.timeout(600)


def _experience(vocab: int, batch: int = 8, prompt: int = 6, actions: int = 5) -> Experience:
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, vocab, (batch, prompt + actions), generator=generator)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :2] = 0  # a left-padded prompt
    action_mask = torch.ones(batch, actions, dtype=torch.bool)
    action_mask[1, 3:] = False  # a response that ended early
    return Experience(
        sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
        action_log_probs=torch.full((batch, actions), -3.0),
        advantages=torch.randn(batch, actions, generator=generator),
    )


def _actor_group(model_path, ranks: int) -> ModelGroup:
    placement = Placement(use_gpu=False, bundles=ranks, ranks={"actor": list(range(ranks))})
    group = ModelGroup("actor", create_placement_group(placement), placement)
    training = TrainingSpec(
        zero_stage=3, bf16=False, learning_rate=1e-3, lr_warmup_ratio=0, lr_scheduler="constant",
        train_batch_size=8, micro_train_batch_size=2, micro_rollout_batch_size=2,
    )
    model = ModelSpec(path=str(model_path), dtype="float32")
    ray.get(group.setup(ModelConfig(role="actor", path=str(model_path), model=model, training=training, optimizer_steps=4)))
    return group


def test_two_rank_zero3_group_matches_one_rank(tiny_model, local_ray):
    experience = _experience(vocab=300)
    results = {}
    for ranks in (2, 1):
        group = _actor_group(tiny_model, ranks)
        before = ray.get(group.call("checksums"))
        log_probs = group.forward(experience.sequences, experience.attention_mask, experience.num_actions)
        metrics = mean_metrics(group.train(experience, train_batch_size=8, micro_batch_size=2, epochs=2,
                              generator=torch.Generator().manual_seed(0)))
        after = ray.get(group.call("checksums"))
        results[ranks] = (before, log_probs, metrics, after)
        for worker in group.workers:
            ray.kill(worker)

    before, log_probs, metrics, after = results[2]
    assert after[0] == after[1], "ranks of one ZeRO-3 group see different parameters"
    assert before[0] == before[1]
    changed = [name for name in after[0] if after[0][name] != before[0][name]]
    assert len(changed) == len(after[0]), "a training step must update every parameter"
    assert log_probs.shape == (8, 5) and torch.isfinite(log_probs).all()
    assert {"policy_loss", "clip_fraction", "entropy", "learning_rate"} <= metrics.keys()

    # Data parallelism must not change the maths: 2 ranks of 2 micro-batches each, or 1 rank of 4,
    # average the same gradients.
    single_before, single_log_probs, _, single_after = results[1]
    torch.testing.assert_close(log_probs, single_log_probs, rtol=1e-4, atol=1e-4)
    for name, value in single_after[0].items():
        assert value == pytest.approx(after[0][name], rel=1e-3, abs=1e-3), name


def test_reward_model_group_scores_like_the_local_scorer(tiny_reward_model, local_ray):
    """The reward-model group (2 ZeRO-3 ranks) gives a `type: model` source the scores the
    in-process RewardModelScorer gives, whole texts and step by step; 5 texts over 2 ranks also
    exercise the padding."""
    from rlhf_trainer.rewards import RewardModelScorer

    placement = Placement(use_gpu=False, bundles=2, ranks={"reward": [0, 1]})
    group = ModelGroup("reward", create_placement_group(placement), placement)
    path = str(tiny_reward_model)
    ray.get(group.setup(ModelConfig(role="reward", path=path, model=ModelSpec(path=path, dtype="float32"),
                                    training=TrainingSpec(zero_stage=3, bf16=False, micro_rollout_batch_size=2))))
    prompts = ["Ada: Say c.", "Bo: Type a many times.", "Cy: Letter: h", "Dee: Say b.", "Eli: Please write d."]
    completions = ["ccc", "a", "hhhhhhhh", "", "dx"]
    local = RewardModelScorer(path)
    torch.testing.assert_close(group.score(prompts, completions), local(prompts, completions), rtol=1e-5, atol=1e-5)
    # a process reward source's reading: each step's end, aggregated
    completions = ["cc\nc", "a\n", "h\nhh\nhhh", "", "d\nx"]
    steps = StepReward(aggregation="product")
    torch.testing.assert_close(group.score(prompts, completions, steps), local(prompts, completions, steps),
                               rtol=1e-5, atol=1e-5)
