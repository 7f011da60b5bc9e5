"""Critic loss: squared error to the returns, optionally clipped around the rollout-time values."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .aggregation import aggregate_loss, masked_mean


class ValueLoss(NamedTuple):
    loss: Tensor  # [] aggregated value loss
    clip_fraction: Tensor  # [] share of valid tokens where the clipped error was the larger one

    def metrics(self) -> dict[str, float]:
        """Detached scalars for logging, keyed by field name."""
        return {k: float(v.detach()) for k, v in self._asdict().items()}


def value_loss_per_token(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float | None = 0.2
) -> tuple[Tensor, Tensor]:
    """``0.5 * max((V - R)^2, (V_clip - R)^2)`` per token, ``V_clip = V_old + clip(V - V_old, +-eps)``.

    Value clipping as in PPO's reference implementation (Engstrom et al. 2020, arXiv 2005.12729);
    ``clip_eps=None`` gives the plain ``0.5 * (V - R)^2``. Returns ``(loss [B, T], clipped [B, T] bool)``.
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    clip_eps: float | None = 0.2,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> ValueLoss:
    """Aggregated (clipped) value loss over ``action_mask`` (Engstrom et al. 2020, arXiv 2005.12729); inputs [B, T]."""
    loss, is_clipped = value_loss_per_token(values, old_values, returns, clip_eps)
    with torch.no_grad():
        clip_fraction = masked_mean(is_clipped.to(loss.dtype), action_mask)
    return ValueLoss(aggregate_loss(loss, action_mask, aggregation, normalizer), clip_fraction)
