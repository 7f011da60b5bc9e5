"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

GRPO's advantages with one importance ratio per response, the length-normalised sequence ratio
``s_i = exp(mean_t(log pi_theta(y_t) - log pi_old(y_t)))``, clipped as PPO clips a token's (the
catalogue's clip ranges for gspo are 3e-4 / 4e-4: a sequence ratio stays much nearer 1 than a token's).

The loss is written per token in the paper's GSPO-token form, ``s_i,t = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]``:
its value is ``s_i`` at every token and, with a sequence's advantage on each of its tokens, its
gradient is GSPO's. Aggregated by seq-mean-token-mean (gspo's default) it is the paper's objective,
``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``.
"""

from __future__ import annotations

from torch import Tensor

from rlhf_api.v1alpha1 import TrainingSpec

from .aggregation import masked_mean
from .policy import POLICY_LOSSES, clipped_surrogate


@POLICY_LOSSES.register("gspo")
def gspo(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor,
         training: TrainingSpec) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped surrogate of the sequence ratio, per token [B, T], with training.clipEps, clipEpsHigh and dualClip."""
    sequence = masked_mean(log_probs - old_log_probs, action_mask, dim=-1).unsqueeze(-1)  # log s_i, [B, 1]
    log_ratio = sequence.detach() + log_probs - log_probs.detach()  # log s_i,t: s_i's value, the token's gradient
    return clipped_surrogate(log_ratio, advantages, training.clip_eps, training.clip_eps_high or None,
                             training.dual_clip)
