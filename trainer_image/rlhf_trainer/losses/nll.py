"""The likelihood of the kept samples: rejection sampling fine-tuning (RAFT, Dong et al. 2023,
arXiv 2304.06767; the best-of-n step of Touvron et al. 2023, Llama 2, arXiv 2307.09288).

Per token ``-A_t * log pi_theta(y_t)`` with the best-of-n estimator's ``A`` of 1 on a kept sample's
tokens and 0 elsewhere: supervised fine-tuning on the samples the reward picked, without PPO's ratio
or clip (each epoch over the batch is another pass of SFT on it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import TrainingSpec

from .policy import POLICY_LOSSES


@POLICY_LOSSES.register("nll")
def nll(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor,
        training: TrainingSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Advantage-weighted negative log-likelihood per token [B, T]; nothing is clipped."""
    nothing = torch.zeros_like(log_probs, dtype=torch.bool)
    return -advantages * log_probs, nothing, nothing
