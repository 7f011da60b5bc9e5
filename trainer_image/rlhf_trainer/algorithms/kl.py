"""Per-token KL estimators and the two ways of applying a KL penalty.

Estimators of KL(pi || pi_ref) from samples of pi, with ``log_ratio = log pi(a) - log pi_ref(a)``
(Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

- ``k1 = log_ratio``: unbiased, high variance, can be negative; its expected gradient is zero, so in
  the loss it regularises nothing (the API refuses ``placement: loss`` with k1).
- ``k2 = log_ratio**2 / 2``: biased, low variance, non-negative.
- ``k3 = (exp(-log_ratio) - 1) + log_ratio``: unbiased, low variance, non-negative.

Every estimate is clamped to ``[-KL_BOUND, KL_BOUND]`` (OpenRLHF's ``compute_approx_kl``) and k3's
log-ratio to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before its exponential (verl's ``kl_penalty``):
a token the policy has moved far from the reference gives a finite penalty and a finite gradient.

Applied either in the reward (``kl_in_reward``: ``r_t -= coef * kl_t`` before advantages, as in
InstructGPT, Ouyang et al. 2022, arXiv 2203.02155) or in the loss (``kl_in_loss``:
``loss += coef * agg(kl)``, as in GRPO, Shao et al. 2024, arXiv 2402.03300).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from ..losses.aggregation import Registry, aggregate_loss

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
KL_PLACEMENTS = ("reward", "loss")
KL_BOUND = 10.0  # per-token estimates are clamped to +-10 (OpenRLHF, verl)
LOG_RATIO_BOUND = 20.0  # log-ratios are clamped to +-20 before exp: e^20 ~ 5e8 (verl; the PPO ratio too)


@KL_ESTIMATORS.register("k1")
def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``log pi - log pi_ref`` per token [B, T] (Schulman 2020, joschu.net/blog/kl-approx.html)."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("k2")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``(log pi - log pi_ref)**2 / 2`` per token [B, T] (Schulman 2020, joschu.net/blog/kl-approx.html)."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``pi_ref/pi - 1 - log(pi_ref/pi)`` per token [B, T] (Schulman 2020, joschu.net/blog/kl-approx.html),
    the log-ratio clamped to ``+-LOG_RATIO_BOUND`` before exp as verl does."""
    neg_log_ratio = (ref_log_probs - log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return neg_log_ratio.exp() - 1.0 - neg_log_ratio


def compute_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    action_mask: Tensor | None = None,
    estimator: str = "k1",
    clamp: float | None = None,
) -> Tensor:
    """Per-token KL ``[B, T]`` with the named estimator, clamped to ``+-KL_BOUND`` (OpenRLHF's
    ``compute_approx_kl``), 0 outside ``action_mask``.

    ``clamp`` also bounds the log-ratio to ``[-clamp, clamp]`` before estimating (None: only k3's
    own bound, ``LOG_RATIO_BOUND``).
    """
    fn = KL_ESTIMATORS[estimator]
    if clamp is not None:
        log_ratio = (log_probs - ref_log_probs).clamp(-clamp, clamp)
        log_probs, ref_log_probs = ref_log_probs + log_ratio, ref_log_probs
    kl = fn(log_probs, ref_log_probs).clamp(-KL_BOUND, KL_BOUND)
    return kl if action_mask is None else kl * action_mask.to(kl.dtype)


def kl_in_reward(kl: Tensor, coef: float, action_mask: Tensor) -> Tensor:
    """Per-token reward penalty ``coef * kl`` [B, T] (0 outside the mask); advantages subtract it."""
    return coef * kl * action_mask.to(kl.dtype)


def kl_in_loss(
    kl: Tensor,
    coef: float,
    action_mask: Tensor,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """Scalar loss term ``coef * agg(kl)`` to add to the policy loss."""
    return coef * aggregate_loss(kl, action_mask, aggregation, normalizer)
