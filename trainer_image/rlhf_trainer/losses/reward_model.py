"""Reward-model losses: pairwise (outcome) and per step (process)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def pairwise_reward_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float | None = None
) -> Tensor:
    """Bradley-Terry ``mean(-log sigmoid(r_c - r_r - margin))`` over pairs [B] (Ouyang et al. 2022, arXiv 2203.02155).

    ``margin`` (scalar or [B]) is Llama 2's preference-strength margin (Touvron et al. 2023, arXiv 2307.09288).
    """
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def reward_accuracy(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Share of pairs [B] where the chosen response scores strictly higher."""
    return (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean()


def process_reward_loss(step_scores: Tensor, labels: Tensor) -> Tensor:
    """Binary cross-entropy of each step's score [S] (a logit) against its label [S] (1. correct, 0. wrong), the
    mean over the steps (Lightman et al. 2023, arXiv 2305.20050; Wang et al. 2024, Math-Shepherd, arXiv 2312.08935)."""
    return F.binary_cross_entropy_with_logits(step_scores.float(), labels.float())


def step_accuracy(step_scores: Tensor, labels: Tensor) -> Tensor:
    """Share of steps [S] whose score says what their label does (positive for a correct step)."""
    return ((step_scores > 0) == (labels > 0.5)).float().mean()
