"""spec.rollout.dynamicSampling and spec.rollout.lengthShaping: DAPO's batch filter and length penalties
(Yu et al. 2025, arXiv:2503.14476)."""

from __future__ import annotations

from pydantic import Field

from .base import APIModel, cel


class DynamicSamplingSpec(APIModel):
    """Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476): a prompt whose samples all earn the same reward
    has zero group advantage and trains nothing, so such groups are dropped and more prompts are sampled until the
    batch holds rolloutBatchSize useful groups. Needs samplesPerPrompt >= 2."""

    model_config = cel(
        ("!has(self.minMeanReward) || !has(self.maxMeanReward) || self.minMeanReward <= self.maxMeanReward",
         "dynamicSampling.minMeanReward must not exceed maxMeanReward", ".minMeanReward"),
    )

    enabled: bool = False
    """Drop groups whose rewards are all equal (and those outside the mean-reward range) and sample again."""
    min_mean_reward: float | None = None
    """Also drop groups whose mean reward is below this (e.g. prompts the policy never solves)."""
    max_mean_reward: float | None = None
    """Also drop groups whose mean reward is above this (e.g. prompts the policy always solves)."""
    max_extra_rounds: int = Field(4, ge=0, le=100)
    """Extra rollouts of rolloutBatchSize fresh prompts a step may take to fill its batch. When the cap is reached the batch is completed with dropped groups (reported as dynamic_sampling/refilled_groups). Extra rounds consume prompts: the data passes (episodes) end sooner."""


class LengthShapingSpec(APIModel):
    """Penalties on long completions, added to the total reward (DAPO's overlong reward shaping, Yu et al. 2025,
    arXiv:2503.14476). Both are off by default."""

    overlong_buffer_tokens: int = Field(0, ge=0)
    """The last N tokens before rollout.maxNewTokens are a soft buffer: a completion reaching into it loses overlongPenalty * (tokens into the buffer) / N. 0 disables it."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The penalty of a completion at the full maxNewTokens (the buffer's penalty grows linearly to it)."""
    truncation_penalty: float = Field(0.0, ge=0)
    """Subtracted from the reward of a completion cut by the length limit (it did not stop by itself); 0 disables it."""
