"""Masked reductions and loss aggregation: the one home of every masked mean in the trainer.

Loss aggregation modes (names shared with the API's ``lossAggregation`` enum):

- ``token-mean``: every valid token weighs the same (DAPO, Yu et al. 2025, arXiv 2503.14476): the
  token sum over the batch's valid tokens, or over ``normalizer`` (the trainer passes the count of the
  whole optimizer step, across micro-batches and ranks, so that a token of a short response weighs
  no more than one of a long response in another micro-batch).
- ``seq-mean-token-mean``: mean over tokens per sequence, then over sequences (GRPO as published,
  Shao et al. 2024, arXiv 2402.03300).
- ``seq-mean-token-sum``: sum over tokens per sequence, then mean over sequences (no length
  normalization; Liu et al. 2025 "Understanding R1-Zero-Like Training", arXiv 2503.20783).
- ``seq-mean-token-sum-norm``: as ``seq-mean-token-sum`` divided by a constant token budget
  (Dr. GRPO's reference code divides by a fixed generation budget, Liu et al. 2025, arXiv 2503.20783).
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)


class Registry(dict[str, F], Generic[F]):
    """A name -> function dict whose unknown-name error lists the valid names.

    ``registry[name]`` raises ``KeyError`` naming the valid keys; ``@registry.register(name)`` adds.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return decorator

    def __missing__(self, name: str) -> F:
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")


# ---------------------------------------------------------------------------------------------
# masked reductions (mask: 1/True where the token counts, same shape as x or broadcastable)
# ---------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (all dims when ``dim`` is None)."""
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked positions; an all-masked row gives 0, never NaN."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of ``x`` over all masked positions (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    count = mask.to(x.dtype).sum()
    denom = count - 1.0 if unbiased else count
    return sq / denom.clamp(min=1.0)


def masked_whiten(
    x: Tensor, mask: Tensor, eps: float = 1e-8, unbiased: bool = False, shift_mean: bool = True
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked positions; positions outside the mask become 0."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask, unbiased=unbiased) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# loss aggregation registry: fn(loss [B, T], mask [B, T], normalizer) -> scalar
# ---------------------------------------------------------------------------------------------

Aggregator = Callable[[Tensor, Tensor, "float | None"], Tensor]
LOSS_AGGREGATIONS: Registry[Aggregator] = Registry("loss aggregation")


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss: Tensor, mask: Tensor, normalizer: float | None = None) -> Tensor:
    """Token sum over ``normalizer`` tokens, by default the batch's valid ones (DAPO, Yu et al. 2025, arXiv 2503.14476)."""
    return masked_mean(loss, mask) if normalizer is None else masked_sum(loss, mask) / normalizer


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, normalizer: float | None = None) -> Tensor:
    """Per-sequence token mean, then mean over sequences (GRPO, Shao et al. 2024, arXiv 2402.03300)."""
    return masked_mean(loss, mask, dim=-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: Tensor, mask: Tensor, normalizer: float | None = None) -> Tensor:
    """Per-sequence token sum, then mean over sequences (Liu et al. 2025, arXiv 2503.20783)."""
    return masked_sum(loss, mask, dim=-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, normalizer: float | None = None) -> Tensor:
    """Per-sequence token sum over a constant budget (default T), mean over sequences (Dr. GRPO, arXiv 2503.20783)."""
    budget = float(loss.shape[-1]) if normalizer is None else float(normalizer)
    if budget <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a positive normalizer, got {budget}")
    return masked_sum(loss, mask, dim=-1).mean() / budget


def aggregate_loss(
    loss: Tensor, mask: Tensor, mode: str = "token-mean", normalizer: float | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar with the named aggregation mode."""
    return LOSS_AGGREGATIONS[mode](loss, mask, normalizer)
