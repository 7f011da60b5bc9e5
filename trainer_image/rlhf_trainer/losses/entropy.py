"""Token entropy of the policy and the entropy bonus."""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``H = logsumexp(z) - sum softmax(z) * z`` per position: logits [B, T, V] -> [B, T]."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor,
    action_mask: Tensor,
    coef: float,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Loss term ``-coef * agg(entropy)`` rewarding exploration (Mnih et al. 2016, arXiv 1602.01783)."""
    return -coef * aggregate_loss(entropy, action_mask, aggregation, normalizer)
