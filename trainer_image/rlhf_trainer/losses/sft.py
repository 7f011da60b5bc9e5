"""Supervised fine-tuning: masked token negative log-likelihood."""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate_loss


def token_log_probs(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[label]`` per position: logits [B, T, V], labels [B, T] -> [B, T]."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sft_loss(
    log_probs: Tensor,
    loss_mask: Tensor,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Masked NLL ``agg(-log p(y_t))`` of target tokens [B, T] (SFT stage, Ouyang et al. 2022, arXiv 2203.02155)."""
    return aggregate_loss(-log_probs, loss_mask, aggregation, normalizer)
