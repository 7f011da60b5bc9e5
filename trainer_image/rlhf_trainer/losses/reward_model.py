"""Pairwise reward-model loss."""

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
