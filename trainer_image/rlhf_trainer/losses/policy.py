"""The actor's policy losses, one registry (the catalogue names each online algorithm's), and the
PPO clipped surrogate they build on, with optional dual-clip and asymmetric (clip-higher) bounds.

Every policy loss is ``loss(log_probs, old_log_probs, advantages, action_mask, training)`` with
[B, T] tensors and the job's TrainingSpec (its knobs), returning per-token ``(loss, clipped,
dual_clipped)``: `policy_loss` aggregates them by training.lossAggregation.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import TrainingSpec

from ..algorithms.kl import LOG_RATIO_BOUND, kl_k3
from .aggregation import Registry, aggregate_loss, masked_mean

PerTokenLoss = Callable[[Tensor, Tensor, Tensor, Tensor, TrainingSpec], "tuple[Tensor, Tensor, Tensor]"]
POLICY_LOSSES: Registry[PerTokenLoss] = Registry("policy loss")


class PolicyLoss(NamedTuple):
    loss: Tensor  # [] aggregated clipped surrogate loss (to minimize)
    clip_fraction: Tensor  # [] share of valid tokens where the clipped branch is the active one
    dual_clip_fraction: Tensor  # [] share of valid tokens bounded by the dual clip (0 when off)
    approx_kl: Tensor  # [] k3 estimate of KL(pi_old || pi_theta) over valid tokens

    def metrics(self) -> dict[str, float]:
        """Detached scalars for logging, keyed by field name."""
        return {k: float(v.detach()) for k, v in self._asdict().items()}


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``-min(rA, clip(r)A)`` with ``r = exp(log_ratio)`` (Schulman et al. 2017, arXiv 1707.06347).

    ``clip_eps_high`` (default ``clip_eps_low``) is DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476).
    ``dual_clip = c > 1`` also bounds the loss of negative-advantage tokens by ``-c A`` (Ye et al. 2020,
    arXiv 1912.09729). The log-ratio is clamped to ``+-LOG_RATIO_BOUND`` before exp, as verl does: an
    outlier token (a log-prob the rollout engine and the trainer disagree on) keeps a finite loss and
    gradient. Returns ``(loss, clipped, dual_clipped)``, the last two boolean.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is None:
        return loss, is_clipped, torch.zeros_like(is_clipped)
    bound = -dual_clip * advantages
    is_dual = (advantages < 0) & (loss > bound)
    return torch.where(is_dual, bound, loss), is_clipped, is_dual


def ppo_clip_per_token(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`clipped_surrogate` of the token ratio ``pi_theta / pi_old``, all tensors [B, T]."""
    return clipped_surrogate(log_probs - old_log_probs, advantages, clip_eps_low, clip_eps_high, dual_clip)


@POLICY_LOSSES.register("ppo-clip")
def ppo_clip(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor,
             training: TrainingSpec) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip on token ratios with training.clipEps, clipEpsHigh (0: clipEps) and dualClip."""
    return ppo_clip_per_token(log_probs, old_log_probs, advantages, training.clip_eps,
                              training.clip_eps_high or None, training.dual_clip)


def policy_loss(
    per_token: tuple[Tensor, Tensor, Tensor],
    log_probs: Tensor,
    old_log_probs: Tensor,
    action_mask: Tensor,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> PolicyLoss:
    """A policy loss's per-token ``(loss, clipped, dual_clipped)`` aggregated over ``action_mask``, with its metrics."""
    loss, is_clipped, is_dual = per_token
    with torch.no_grad():
        clip_fraction = masked_mean(is_clipped.to(loss.dtype), action_mask)
        dual_fraction = masked_mean(is_dual.to(loss.dtype), action_mask)
        approx_kl = masked_mean(kl_k3(old_log_probs, log_probs), action_mask)
    return PolicyLoss(
        aggregate_loss(loss, action_mask, aggregation, normalizer), clip_fraction, dual_fraction, approx_kl
    )


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> PolicyLoss:
    """PPO-clip loss over ``action_mask`` aggregated by ``aggregation`` (Schulman et al. 2017, arXiv 1707.06347).

    Inputs are [B, T]: current and rollout-time log-probs of the response tokens and their advantages.
    """
    per_token = ppo_clip_per_token(log_probs, old_log_probs, advantages, clip_eps_low, clip_eps_high, dual_clip)
    return policy_loss(per_token, log_probs, old_log_probs, action_mask, aggregation, normalizer)
