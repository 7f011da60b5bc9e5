"""Rollout correction: truncated importance sampling (TIS) against the rollout engine's log-probs.

vLLM samples with its own kernels and precision, so its probability of a sampled token differs from
the trainer's for the same weights: the rollouts are slightly off-policy even with no update in
between (more in bf16 and with async rollouts). Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training") weigh each token's policy loss by the ratio of the
trainer's to the engine's probability, truncated at C so a token the engine found unlikely cannot
dominate: ``w = min(exp(old_log_prob - engine_log_prob), C)``. verl calls this rollout correction
(token-level ``rollout_is`` with ``rollout_is_threshold``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .aggregation import masked_mean


class RolloutWeights(NamedTuple):
    weights: Tensor  # [B, T] min(exp(old - engine), cap), no gradient
    clipped_fraction: Tensor  # [] share of valid tokens whose weight the cap bounded


@torch.no_grad()
def truncated_is_weights(old_log_probs: Tensor, engine_log_probs: Tensor, action_mask: Tensor,
                         cap: float) -> RolloutWeights:
    """Per-token TIS weights [B, T] from the trainer's rollout-time log-probs and the engine's
    sampling log-probs of the same tokens, and the share of valid tokens the cap bounded."""
    ratio = (old_log_probs - engine_log_probs).exp()  # inf for a -inf engine log-prob: weight cap
    return RolloutWeights(ratio.clamp(max=cap), masked_mean((ratio > cap).to(ratio.dtype), action_mask))
