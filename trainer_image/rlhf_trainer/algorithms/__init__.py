"""RL algorithm core: advantage estimators and KL estimators, each behind a registry."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    READS_ACTOR_LOG_PROBS,
    compute_advantages,
    discounted_returns,
    register_advantage,
    token_rewards,
)
from .kl import KL_ESTIMATORS, KL_PLACEMENTS, compute_kl, kl_in_loss, kl_in_reward

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageInputs",
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "READS_ACTOR_LOG_PROBS",
    "compute_advantages",
    "compute_kl",
    "discounted_returns",
    "kl_in_loss",
    "kl_in_reward",
    "register_advantage",
    "token_rewards",
]
