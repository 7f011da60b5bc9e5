"""Scored rollouts, and what DAPO does to them before they train (Yu et al. 2025, arXiv:2503.14476):

- length shaping: `length_penalty`, the overlong buffer's soft penalty and the truncation penalty, added with
  the environment's reward to the sources' total by `shape_rewards` (which keeps the task's own reward apart);
- dynamic sampling: `informative_groups` keeps the groups whose task rewards differ (a group with equal rewards
  has zero advantage under every grouped estimator, so it adds no gradient, only dilutes the batch), and
  `fill_batch` assembles a full batch from several rounds, kept groups first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import DynamicSamplingSpec, LengthShapingSpec, RLHFJobSpec

from .data import PromptItem
from .rewards import RewardResult
from .workers.rollout import Completion


@dataclass
class Rollout:
    """Scored samples, prompt-major: the `n` samples of a prompt are adjacent (a group)."""

    prompts: list[PromptItem]  # the prompt of each sample
    samples: list[Completion]
    reward: RewardResult  # total and by_source, [N] each
    seconds: float  # generation time
    # The policy's tokens generated in those seconds (unset: the samples'). Like the seconds, a part of
    # a rollout keeps the whole's: tokens / seconds is the engines' throughput, dropped groups included.
    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokens is None:
            self.tokens = sum(sum(c.trained) for c in self.samples)

    def groups(self, keep: Tensor, n: int) -> Rollout:
        """The groups (of n samples) where keep [G] is True, in order."""
        rows = keep.repeat_interleave(n).nonzero().flatten().tolist()
        reward = RewardResult(self.reward.total[rows], {k: v[rows] for k, v in self.reward.by_source.items()},
                              self.reward.task[rows])
        return Rollout([self.prompts[i] for i in rows], [self.samples[i] for i in rows], reward, self.seconds,
                       self.tokens)

    def __len__(self) -> int:
        return len(self.samples)

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """One rollout from several (the sources must match); seconds and tokens add up."""
        total, task = (torch.cat([getattr(p.reward, field) for p in parts]) for field in ("total", "task"))
        by_source = {k: torch.cat([p.reward.by_source[k] for p in parts]) for k in parts[0].reward.by_source}
        return Rollout([x for p in parts for x in p.prompts], [x for p in parts for x in p.samples],
                       RewardResult(total, by_source, task), sum(p.seconds for p in parts), sum(p.tokens for p in parts))


def staleness(samples: list[Completion], policy: int) -> dict[str, float]:
    """How far the samples' tokens lag the policy being trained (version `policy`, the weight syncs before
    it): the oldest token's lag (training.asyncQueueSize bounds it), and the share of samples whose tokens
    come from more than one policy (rollout.partial). Nothing for samples no engine stamped."""
    versions = [sample.versions for sample in samples if sample.versions]
    if not versions:
        return {}
    return {"rollout/staleness_max": float(policy - min(v[0] for v in versions)),
            "rollout/partial_fraction": sum(v[0] != v[-1] for v in versions) / len(versions)}


def shape_rewards(result: RewardResult, samples: list[Completion], spec: RLHFJobSpec) -> RewardResult:
    """The reward sources' result with the environment's episode reward added (times rewardWeight to
    the total, unweighted to the task's reward) and the length penalties (to the total), which
    reward.clip then bounds."""
    environment, rollout = spec.environment, spec.rollout
    if environment:
        result.by_source["environment"] = torch.tensor([c.env_reward for c in samples], dtype=torch.float32)
        result.total = result.total + environment.reward_weight * result.by_source["environment"]
        result.task = result.task + result.by_source["environment"]
    shaping = rollout.length_shaping
    if shaping.overlong_buffer_tokens or shaping.truncation_penalty:
        # The policy's own tokens: an episode's observations are not its length.
        result.by_source["length_penalty"] = length_penalty(
            torch.tensor([sum(c.trained) for c in samples]), torch.tensor([c.truncated for c in samples]),
            rollout.max_new_tokens, shaping)
        result.total = result.total + result.by_source["length_penalty"]
    if spec.reward and spec.reward.clip is not None:
        result.total = result.total.clamp(-spec.reward.clip, spec.reward.clip)
    return result


def length_penalty(lengths: Tensor, truncated: Tensor, max_new_tokens: int, spec: LengthShapingSpec) -> Tensor:
    """[N] non-positive reward shaping. Overlong buffer (DAPO eq. 13): a completion of L tokens loses
    overlongPenalty * (L - (maxNewTokens - N)) / N once it reaches into the last N tokens of the budget.
    Truncation: a completion cut by the limit loses truncationPenalty."""
    penalty = torch.zeros(len(lengths), dtype=torch.float32)
    buffer = spec.overlong_buffer_tokens
    if buffer:
        into_buffer = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
        penalty -= spec.overlong_penalty * into_buffer / buffer
    return penalty - spec.truncation_penalty * truncated.float()


def informative_groups(reward: RewardResult, n: int, spec: DynamicSamplingSpec) -> Tensor:
    """[G] True for the groups of n task rewards (not the shaped total: an all-correct group does not
    differ by its length penalties) that are not all equal and whose mean is within the range."""
    groups = reward.task.reshape(-1, n)
    keep = (groups != groups[:, :1]).any(dim=1)
    mean = groups.mean(dim=1)
    if spec.min_mean_reward is not None:
        keep &= mean >= spec.min_mean_reward
    if spec.max_mean_reward is not None:
        keep &= mean <= spec.max_mean_reward
    return keep


def fill_batch(kept: list[Rollout], dropped: list[Rollout], groups: int, n: int) -> tuple[Rollout, int]:
    """A rollout of exactly `groups` groups: the kept ones first, then, when they are too few, dropped ones;
    and how many dropped groups it took."""
    kept_all = Rollout.concat(kept)  # one part per round: its seconds and tokens are all the rounds'
    missing = max(0, groups - len(kept_all) // n)
    batch = Rollout.concat([kept_all, Rollout.concat(dropped)]) if missing else kept_all
    batch = batch.groups(torch.arange(len(batch) // n) < groups, n)
    return replace(batch, seconds=kept_all.seconds, tokens=kept_all.tokens), missing
