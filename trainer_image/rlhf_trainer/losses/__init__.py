"""Trainer losses: one module per loss, each citing its paper; masked reductions live in aggregation.

Every module of this package is imported here, so a new loss module's registrations (e.g.
``@POLICY_LOSSES.register``) take effect without a line in this file.
"""

import importlib
import pkgutil

from .aggregation import (
    LOSS_AGGREGATIONS,
    Registry,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .distillation import top_k_divergence
from .entropy import entropy_bonus, entropy_from_logits
from .policy import (
    POLICY_LOSSES,
    PolicyLoss,
    clipped_surrogate,
    policy_loss,
    ppo_clip_per_token,
    ppo_policy_loss,
)
from .preference import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceInputs,
    PreferenceLoss,
    cdpo_loss,
    dpo_loss,
    ipo_loss,
    kto_loss,
)
from .reward_model import pairwise_reward_loss, process_reward_loss, reward_accuracy, step_accuracy
from .rollout_correction import RolloutWeights, truncated_is_weights
from .sft import sft_loss, token_log_probs
from .value import ValueLoss, value_loss, value_loss_per_token

__all__ = [
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "PolicyLoss",
    "PreferenceConfig",
    "PreferenceInputs",
    "PreferenceLoss",
    "Registry",
    "RolloutWeights",
    "ValueLoss",
    "aggregate_loss",
    "cdpo_loss",
    "clipped_surrogate",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "ipo_loss",
    "kto_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_reward_loss",
    "policy_loss",
    "ppo_clip_per_token",
    "ppo_policy_loss",
    "process_reward_loss",
    "reward_accuracy",
    "sft_loss",
    "step_accuracy",
    "token_log_probs",
    "top_k_divergence",
    "truncated_is_weights",
    "value_loss",
    "value_loss_per_token",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
